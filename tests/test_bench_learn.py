"""`crest bench learn`: the stream learns only from requests that finished before the current one, its in-memory
live tier holds exactly the rows `refresh_live` publishes from the same learned rows, its window cuts rows as
`read_window` does, and the command writes its files (and reuses recorded continuations) on a tiny random model.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client.codec import TokenTable, decode_tree
from crest_client.draft import Draft

from crest import db
from crest.bench.adaptive import estimated_speedup, quiet_cpu_cost
from crest.bench.learn import REST_ROW, ROWS, LearnOptions, learned_rows, make_row_drafter, stream
from crest.bench.live_memory import LiveTrees, learned_window
from crest.bench.replay import replay
from crest.cli.app import main
from crest.config import IngestOptions
from crest.decoding.generator import SpeculativeGenerator
from crest.decoding.policy import DraftPolicy
from crest.drafters.suffix_array import RestIndex
from crest.errors import ConfigError
from crest.ingest.pipeline import ingest
from crest.learning import append_learned, read_window, refresh_live
from crest.learning.live import published_version, static_options
from tests.fix_corpus import make_word_tokenizer, write_jsonl
from tests.fix_models import IdTokenizer, tiny_model

pytest_plugins = ["tests.fix_corpus"]

OPTIONS = IngestOptions(top_t=1000, max_n=3, continuation_length=4)
WORDS = [f"w{i}" for i in range(30)]


@pytest.mark.parametrize(
    ("i", "every", "rows"),
    [(0, 1, 0), (1, 1, 1), (5, 1, 5), (0, 3, 0), (2, 3, 0), (3, 3, 3), (5, 3, 3), (6, 3, 6)],
    ids=["first", "second", "sixth", "k3-first", "k3-before-refresh", "k3-after-refresh", "k3-mid", "k3-second"],
)
def test_learned_rows_are_the_finished_requests_before_the_last_refresh(i: int, every: int, rows: int) -> None:
    assert learned_rows(i, refresh_every=every) == rows


def _stream(refs: list[list[int]], *, every: int = 1, min_count: int = 1) -> list[dict[str, Any]]:
    """Replay a stream of refs (prompt [1, 2, 3] each) without a static store; return the per-request figures."""
    opts = LearnOptions(store="none", max_new_tokens=40, refresh_every=every, min_count=min_count)
    done = stream(
        opts,
        prompt_ids=[[1, 2, 3]] * len(refs),
        references=refs,
        static_stores={},
        vocab_size=64,
        options=IngestOptions(max_n=2, top_t=1000),
        max_positions=1 << 20,
    )
    return list(done["per_request"])


OUTPUT = list(range(10, 40))  # no token repeats: only a learned copy drafts it


def test_a_request_never_drafts_from_its_own_or_later_outputs() -> None:
    first, second, third = _stream([OUTPUT, OUTPUT, OUTPUT])
    assert first["live"] == 1.0 and first["learned_requests"] == 0  # the next request teaches exactly this output
    assert second["live"] > 3 and second["learned_requests"] == 1  # it repeats the first one's output
    assert third["static+live+prompt"] > 3
    assert first["static"] == first["static+live"] == 1.0  # no static store here


def test_refresh_every_waits_for_the_rebuild() -> None:
    first, second, third = _stream([OUTPUT, OUTPUT, OUTPUT], every=2)
    assert first["live"] == second["live"] == 1.0  # no rebuild before two requests finished
    assert third["live"] > 3 and third["learned_requests"] == 2


def test_min_count_drops_what_was_seen_once() -> None:
    rows = _stream([OUTPUT, OUTPUT, OUTPUT], min_count=2)
    assert rows[1]["live"] == 1.0 and rows[2]["live"] > 3


@pytest.mark.parametrize("window", [1, 5, 9, 10, 1000], ids=["one", "cut-row", "row-edge", "all-but-one", "all"])
def test_learned_window_cuts_rows_as_read_window_does(db_dsn: str, window: int) -> None:
    rows = [[1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    append_learned(db_dsn, "s", rows)
    with db.session(db_dsn) as conn:
        want = read_window(conn, "s", window=window, max_n=OPTIONS.max_n)
    tokens, offsets = learned_window(rows, window=window)
    assert tokens.tolist() == want.tokens.tolist() and offsets.tolist() == want.offsets.tolist()


@pytest.fixture()
def words(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> str:
    """Publish static store `words` (the word tokenizer) and return the DSN."""
    corpus = write_jsonl(tmp_path / "static.jsonl", [{"text": "the cat sat on the mat a dog sat on a mat"}] * 2)
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=OPTIONS)
    return db_dsn


@pytest.mark.parametrize("min_count", [1, 2], ids=["all", "seen-twice"])
def test_live_trees_hold_the_rows_refresh_live_publishes(words: str, min_count: int) -> None:
    served = [[2, 3, 4, 5, 2, 6], [7, 3, 4, 5, 2, 3, 4], [2, 3, 4, 8, 6]]
    append_learned(words, "words", served)
    refresh_live(words, "words", min_count=min_count)
    with db.session(words) as conn:
        static = published_version(conn, "words", "static")
        live = published_version(conn, "words", "live")
    assert static is not None and live is not None
    with psycopg.connect(words) as conn:
        stored = conn.execute("SELECT key, n, count, tree FROM crest_ngrams WHERE store_id = %s", (live["id"],))
        published = {bytes(k): (int(n), int(c), bytes(t)) for k, n, c, t in stored}
        table = conn.execute("SELECT token_table FROM crest_store_data WHERE store_id = %s", (live["id"],)).fetchone()
    options = static_options(static["params"])
    tokens, offsets = learned_window(served, window=1_000_000)
    trees = LiveTrees.build(tokens, offsets, vocab_size=int(static["vocab_size"]), options=options, min_count=min_count)

    def decoded(rows: dict[bytes, tuple[int, int, bytes]], ranks: TokenTable) -> dict[bytes, tuple[Any, ...]]:
        """Return the rows with their trees decoded (a live version ranks tokens by the static version's table)."""
        out = {}
        for key, (n, count, blob) in rows.items():
            tree = decode_tree(blob, n=n, table=ranks)
            out[key] = (n, count, tree.tokens.tolist(), tree.parents.tolist(), tree.weights.tolist())
        return out

    assert table is not None
    assert published and decoded(trees.rows, trees.table) == decoded(published, TokenTable.from_bytes(table[0]))


def test_live_trees_draft_the_longest_learned_continuation() -> None:
    tokens, offsets = learned_window([[5, 6, 7, 8, 9], [5, 6, 7, 8, 9]], window=100)
    trees = LiveTrees.build(tokens, offsets, vocab_size=16, options=IngestOptions(max_n=2, top_t=100), rule="longest")
    draft = trees.draft([1, 6, 7], 8)
    assert draft is not None and draft.n == 2 and draft.tokens.tolist() == [8, 9] and draft.parents.tolist() == [-1, 0]
    assert trees.draft([1, 2, 3], 8) is None and trees.draft([99], 8) is None  # unseen, outside the vocabulary
    assert trees.nbytes > 0


def test_unknown_row_is_refused() -> None:
    with pytest.raises(ConfigError, match="unknown row"):
        make_row_drafter("static+nope", static=None, live=None)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A word tokenizer and a tiny random llama over its vocabulary."""
    directory = make_word_tokenizer(tmp_path_factory.mktemp("tiny-learn"), WORDS)
    model = tiny_model("llama", seed=3, vocab=len(WORDS) + 2, max_positions=512)
    model.config.eos_token_id = 1
    model.generation_config.eos_token_id = 1
    model.save_pretrained(str(directory))
    return directory


def _crest(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["crest", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    captured = capsys.readouterr()
    return int(done.value.code or 0), captured.out, captured.err


def test_bench_learn_writes_its_files_and_reuses_references(
    db_dsn: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_jsonl(tmp_path / "c.jsonl", [{"text": " ".join(WORDS[i : i + 8])} for i in range(0, 22, 2)])
    ingest([str(corpus)], store="tiny", tokenizer=str(tiny_dir), dsn=db_dsn, options=OPTIONS)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": p} for p in ["w1 w2 w3", "w1 w2 w3", "w5 w6 w7"]])
    out = tmp_path / "out"
    args = ["bench", "learn", "--store", "tiny", "--prompts", str(prompts), "--model", str(tiny_dir)]
    args += ["--max-new-tokens", "16", "--min-count", "1", "--dsn", db_dsn, "--out", str(out)]
    code, stdout, err = _crest(monkeypatch, capsys, *args)
    assert code == 0, err
    assert "learning in order" in stdout and "bytes per 1M served tokens" in stdout
    results = json.loads((out / "learn.json").read_text())
    assert [r["drafter"] for r in results["rows"]] == list(ROWS)
    assert results["references"]["decoded"] is True and (out / "references.json").exists()
    first, second, _ = results["per_request"]
    assert first["live"] == 1.0 and second["live"] > 1.0  # the second prompt repeats the first: its output is known
    assert results["storage"]["bytes_per_million_tokens"] > 4_000_000  # 4 bytes a token, plus each row's overhead
    assert "Learned log:" in (out / "learn.md").read_text()
    with db.session(db_dsn) as conn:  # nothing learned or published in the database
        assert conn.execute("SELECT count(*) FROM crest_learned").fetchone() == (0,)
        assert published_version(conn, "tiny", "live") is None

    again = tmp_path / "again"
    args[-1] = str(again)
    args += ["--references", str(out / "references.json"), "--rest", str(corpus)]  # the static store's corpus
    code, _, err = _crest(monkeypatch, capsys, *args)
    assert code == 0, err
    reused = json.loads((again / "learn.json").read_text())
    assert reused["references"]["decoded"] is False and not (again / "references.json").exists()
    assert [r["drafter"] for r in reused["rows"]] == [*ROWS, REST_ROW] and reused["rest"]["tokens"] > 0
    assert [r["mean_accepted_length"] for r in reused["rows"][: len(ROWS)]] == [
        r["mean_accepted_length"] for r in results["rows"]
    ]
    assert reused["cost_model"]["calibrated"] is False and reused["cost_model"]["seconds"][-1] == 0.240


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--refresh-every", "0"], "--refresh-every must be at least 1"),
        (["--store", "nope"], "no published store named 'nope'"),
    ],
    ids=["bad-refresh", "missing-store"],
)
def test_bench_learn_refuses_bad_input_in_one_line(
    db_dsn: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    out = tmp_path / "out"
    args = ["bench", "learn", "--store", "x", "--dsn", db_dsn, "--out", str(out), *extra]
    code, _, err = _crest(monkeypatch, capsys, *args)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and message in lines[0] and "Traceback" not in err
    assert not out.exists()


def test_learn_options_validate() -> None:
    assert LearnOptions(store="s").validate().refresh_every == 1
    with pytest.raises(ConfigError, match="--window"):
        LearnOptions(store="s", window=0).validate()
    assert np.array_equal(learned_window([], window=5)[1], np.zeros(1, dtype=np.int64))


class _Oracle:
    """Drafts the next reference tokens as a chain with a wrong sibling under each, its depth varying by position."""

    def __init__(self, reference: list[int], prompt_len: int, vocab: int) -> None:
        self.reference, self.prompt_len, self.vocab = reference, prompt_len, vocab

    def draft(self, context: Sequence[int], max_nodes: int) -> Draft | None:
        done = len(context) - self.prompt_len
        truth = self.reference[done : done + 1 + done % 5]
        if done % 7 == 3 or not truth:
            return None
        tokens, parents = [], []
        for i, t in enumerate(truth):
            tokens += [t, (t + 1) % self.vocab]
            parents += [2 * (i - 1) if i else -1] * 2
        weights = np.arange(4 * len(tokens), 0, -4) - done % 3
        return Draft(np.array(tokens), np.array(parents, dtype=np.int32), weights, 1, 4 * len(tokens) + 2)


def test_adaptive_replay_takes_the_generators_own_steps() -> None:
    model = tiny_model("llama", seed=5, vocab=64, max_positions=512)
    plain = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=0)
    gen = SpeculativeGenerator(model, IdTokenizer(), cost=quiet_cpu_cost())  # the adaptive size, pinned costs
    policy = DraftPolicy(cost=quiet_cpu_cost())
    for prompt in ([3, 9, 4, 7], [5, 5, 6], [8, 1, 2, 3, 4]):  # the policy's state carries across requests
        ref = plain.generate(prompt, max_new_tokens=48).output_token_ids
        drafter = _Oracle(ref, len(prompt), 64)
        got = gen.generate(prompt, drafter=drafter, max_new_tokens=48)
        replayed = replay(drafter, prompt, ref, policy=policy, max_new_tokens=48, max_positions=gen.max_positions)
        assert got.output_token_ids == ref
        assert (replayed.steps, sum(replayed.nodes)) == (got.forward_passes, got.draft_tokens)
        assert 0 < sum(replayed.nodes) < sum(len(drafter.draft(prompt + ref[:d], 64) or []) for d in range(len(ref)))
    full = replay(drafter, prompt, ref, max_new_tokens=48)  # no policy: every step verifies the whole tree
    whole = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=64).generate(prompt, drafter=drafter,
                                                                                     max_new_tokens=48)  # fmt: skip
    assert (full.steps, sum(full.nodes)) == (whole.forward_passes, whole.draft_tokens)


@pytest.mark.parametrize(
    ("tokens", "nodes", "speedup"),
    [(2, [0, 0], 1.0), (4, [3], 0.065 * 4 / 0.080), (8, [63, 63], 0.065 * 8 / (2 * 0.240))],
    ids=["no-drafts", "one-step", "full-trees"],
)
def test_estimated_speedup_prices_steps_by_the_cost_model(tokens: int, nodes: list[int], speedup: float) -> None:
    assert estimated_speedup(tokens, nodes, [0.0] * len(nodes), quiet_cpu_cost()) == pytest.approx(speedup)


def test_rest_row_drafts_from_its_index_and_learns_nothing() -> None:
    refs = [OUTPUT, OUTPUT]
    index = RestIndex.build(np.asarray(OUTPUT, dtype=np.int32), np.asarray([0, len(OUTPUT)]))
    opts = LearnOptions(store="none", max_new_tokens=40, min_count=1)
    done = stream(
        opts,
        prompt_ids=[[1, 2, 3]] * len(refs),
        references=refs,
        static_stores={},
        vocab_size=64,
        options=IngestOptions(max_n=2, top_t=1000),
        max_positions=1 << 20,
        cost=quiet_cpu_cost(),
        rest_index=index,
    )
    first, second = done["per_request"]
    assert first["rest"] == second["rest"] > 3  # the corpus holds the output from the start; it never changes
    assert first["live"] == 1.0 and second["live"] > 3
    rows = {r["drafter"]: r for r in done["rows"]}
    assert list(rows) == [*ROWS, REST_ROW]
    assert rows["rest"]["adaptive_mean_accepted_length"] > 1.0 and rows["prompt"]["est_speedup_adaptive"] > 0
