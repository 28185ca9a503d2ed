"""`crest bench accept` on a tiny corpus: a word tokenizer, a tiny random llama saved beside it, two sizes, three
prompts, all five drafters and the ablations; the JSON schema, the markdown table, the plots, sane sizes and M,
and the replay of greedy verification against the real loop (same number of steps, token for token)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client.draft import Draft

from crest.bench.accept import AcceptOptions, run_accept
from crest.bench.accept_options import DRAFTERS
from crest.bench.replay import matched_depth, replay
from crest.drafters.prompt import PromptDrafter
from crest.errors import ConfigError, CorpusError
from tests.fix_corpus import make_word_tokenizer, write_jsonl, write_tree
from tests.fix_models import tiny_model

WORDS = [f"w{i}" for i in range(30)]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding a word tokenizer and a tiny random llama over its vocabulary."""
    directory = make_word_tokenizer(tmp_path_factory.mktemp("tiny-accept"), WORDS)
    model = tiny_model("llama", seed=3, vocab=len(WORDS) + 2, max_positions=512)
    model.config.eos_token_id = 1  # [EOS]
    model.generation_config.eos_token_id = 1
    model.save_pretrained(str(directory))
    return directory


PROMPTS = ["w1 w2 w3 w4", "w5 w6 w7", "w0 w0 w8 w9 w10"]


def _corpus(root: Path, model_dir: Path) -> Path:
    """Documents holding the tiny model's own greedy continuations (so datastores draft what it accepts)."""
    from crest.bench.generate import generate_plain
    from crest.decoding.models import load_model

    loaded = load_model(str(model_dir))
    rng = random.Random(0)
    starts = PROMPTS + [" ".join(rng.choice(WORDS) for _ in range(4)) for _ in range(13)]
    files = {}
    for i, text in enumerate(starts):
        ids = loaded.encode_prompt(text)
        out = generate_plain(loaded.model, loaded.tokenizer, ids, max_new_tokens=40).output_token_ids
        files[f"doc{i:02d}.txt"] = loaded.tokenizer.decode(out, skip_special_tokens=True)
    return write_tree(root / "corpus", files)


def spy_measure(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Record the prompts, model and reference continuations `run_accept` measures with (the last call)."""
    import crest.bench.accept

    real = crest.bench.accept.measure
    seen: dict[str, Any] = {}

    def spy(*args: Any, **kwargs: Any) -> dict[str, Any]:
        measured = real(*args, **kwargs)
        seen.update(loaded=kwargs["loaded"], prompt_ids=kwargs["prompt_ids"], references=measured["references"])
        return measured

    monkeypatch.setattr(crest.bench.accept, "measure", spy)
    return seen


def assert_references_are_model_generate(seen: dict[str, Any], max_new_tokens: int) -> None:
    """The reference every `exact` count compares with (crest's loop without drafts) is `model.generate`'s output.

    A row's `exact` counts the prompts whose speculative output equals that reference; the `none` row's is the
    reference itself. With this check, `exact == prompts` means: equal to Hugging Face greedy decoding.
    """
    from crest.bench.generate import generate_plain

    model, tokenizer = seen["loaded"].model, seen["loaded"].tokenizer
    want = [
        generate_plain(model, tokenizer, ids, max_new_tokens=max_new_tokens).output_token_ids
        for ids in seen["prompt_ids"]
    ]
    assert seen["references"] == want


def test_matched_depth_follows_the_greedy_path() -> None:
    # root children 5 and 6; 5 -> 7 -> 9, 5 -> 8
    draft = Draft(np.array([5, 6, 7, 8, 9]), np.array([-1, -1, 0, 0, 2], dtype=np.int32), np.array([5, 4, 3, 2, 1]), 1)
    assert matched_depth(draft, [5, 7, 9, 1]) == 3
    assert matched_depth(draft, [5, 8, 2]) == 2
    assert matched_depth(draft, [6, 7]) == 1
    assert matched_depth(draft, [4]) == 0
    assert matched_depth(draft, [5, 7]) == 2  # never deeper than the known continuation


def test_replay_counts_steps() -> None:
    out = [1, 2, 3, 1, 2, 3, 1, 2, 3]
    r = replay(PromptDrafter(min_ngram=1), [1, 2, 3], out, max_new_tokens=len(out))
    assert r.new_tokens == len(out) and 1 <= r.steps < len(out) and len(r.draft_seconds) == r.steps


@pytest.mark.slow  # every drafter, size, ablation and plot, twice (a minute); the chat test below is the fast one
def test_bench_accept_smoke(db_dsn: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = write_jsonl(
        tmp_path / "prompts.jsonl",
        [{"prompt": text} for text in PROMPTS],
    )
    opts = AcceptOptions(
        corpus=(str(_corpus(tmp_path, tiny_dir)),),
        prompts=str(prompts),
        percents=(25.0, 100.0),
        top_t=(5, 40),
        max_n=2,
        max_new_tokens=24,
        timing="all",
        check=3,
        ablations=True,
        ablation_top_t=(5, 20),
    )
    out = tmp_path / "out"
    argv = ["crest", "bench", "accept", "--out", str(out)]
    seen = spy_measure(monkeypatch)
    results = run_accept(opts, model=str(tiny_dir), dsn=db_dsn, out=out, argv=argv)
    assert_references_are_model_generate(seen, opts.max_new_tokens)
    saved = json.loads((out / "accept.json").read_text())
    assert saved["command"] == "crest bench accept --out " + str(out)
    assert {"python", "torch", "transformers", "crest"} <= set(saved["versions"])
    assert saved["prompts"] == 3 and "replay" in saved["method"]["mean_accepted_length"]
    rows = saved["rows"]
    assert {r["drafter"] for r in rows} == set(DRAFTERS)  # the default rows
    assert len(rows) == 2 + 3 * 2  # none, prompt; rest, crest, crest+prompt at two sizes each
    for row in rows:
        assert row["mean_accepted_length"] >= 1.0
        assert row["draft_ms_median"] >= 0 and row["draft_ms_p99"] >= row["draft_ms_median"]
        assert row["real"] is not None and row["real"]["tokens_per_second"] > 0
        assert row["real"]["exact"] == 3  # speculative greedy output equals the reference, i.e. model.generate
    none = next(r for r in rows if r["drafter"] == "none")
    assert none["mean_accepted_length"] == 1.0 and none["real"]["speedup"] == 1.0
    rest = sorted((r for r in rows if r["drafter"] == "rest"), key=lambda r: r["percent"])
    assert 0 < rest[0]["bytes"] < rest[1]["bytes"]  # REST bytes grow with the sample
    crest = sorted((r for r in rows if r["drafter"] == "crest"), key=lambda r: r["top_t"])
    assert 0 < crest[0]["bytes"] <= crest[1]["bytes"]
    assert max(r["mean_accepted_length"] for r in rest) > 1.5  # the corpus holds the continuations
    assert max(r["mean_accepted_length"] for r in crest) > 1.5
    assert saved["crosscheck"] and all(c["equal"] and c["same_output"] for c in saved["crosscheck"])
    assert set(saved["comparison"]) >= {"storage_ratio_at_rest_best", "equal_storage", "min_gain_at_equal_storage"}
    abl = saved["ablations"]
    assert len(abl["single"]) == len(abl["upto"]) == 2 * 2
    assert all(c["mean_accepted_length"] >= 1.0 and c["ngrams"] > 0 for c in abl["single"] + abl["upto"])
    assert [t["n"] for t in abl["tree_sizes"]] == [1, 2]
    table = (out / "accept.md").read_text()
    assert "| drafter | datastore |" in table and "crest+prompt" in table
    for name in ("accept_custom.png", "ablation_single_custom.png", "ablation_upto_custom.png"):
        assert (out / name).stat().st_size > 1000
    assert sorted(Path(p).name for p in results["plots"]) == sorted(
        ["accept_custom.png", "ablation_single_custom.png", "ablation_upto_custom.png"]
    )
    again = run_accept(opts, model=str(tiny_dir), dsn=db_dsn, out=out, argv=argv)  # datastores are reused
    assert [d["name"] for d in again["datastores"] if not d["reused"]] == []


def test_bench_accept_chat_setting(
    db_dsn: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chat preset end to end: ShareGPT minus held-out conversations, MT-Bench plus held-out first turns."""
    import shutil

    from tests.fix_corpus import write_sharegpt

    chat_dir = tmp_path / "tiny-chat"
    shutil.copytree(tiny_dir, chat_dir)
    config = json.loads((chat_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}w0 {{ m['content'] }} w1 {% endfor %}w2"
    (chat_dir / "tokenizer_config.json").write_text(json.dumps(config))
    corpus = _corpus(tmp_path, tiny_dir)
    turns = [p.read_text() for p in sorted(corpus.iterdir())]
    records = [
        {"id": str(i), "conversations": [{"from": "human", "value": t[:12]}, {"from": "gpt", "value": t}]}
        for i, t in enumerate(turns)
    ]
    monkeypatch.setattr("crest.bench.accept.sharegpt_path", lambda: write_sharegpt(tmp_path / "sg.json", records))
    mt_bench = write_jsonl(tmp_path / "mt.jsonl", [{"turns": [p, "again"]} for p in PROMPTS[:2]])
    opts = AcceptOptions(
        setting="chat",
        mt_bench=str(mt_bench),
        holdout=2,
        drafters=("none", "rest", "crest"),
        percents=(100.0,),
        top_t=(40,),
        max_n=2,
        max_new_tokens=16,
        timing="all",
    )
    out = tmp_path / "out"
    seen = spy_measure(monkeypatch)
    results = run_accept(opts, model=str(chat_dir), dsn=db_dsn, out=out, argv=["crest", "bench", "accept"])
    assert_references_are_model_generate(seen, opts.max_new_tokens)
    assert results["benchmark"] == "accept" and results["setting"] == "chat" and results["options"]["chat"]
    assert results["corpus"]["heldout_conversations"] == 2
    assert results["prompts"] == 2 + 2  # the MT-Bench first turns, then the held-out conversations' first turns
    held = json.loads(next(out.glob("chat_heldout_*.json")).read_text())
    kept = next(out.glob("chat_corpus_*.jsonl")).read_text()
    assert len(held) == 2 and len(kept.splitlines()) == len(records) - 2  # one line per kept conversation
    rows = {r["drafter"]: r for r in results["rows"]}
    assert set(rows) == {"none", "rest", "crest"} and all(r["real"]["exact"] == 4 for r in rows.values())
    assert (out / "accept_chat.png").stat().st_size > 1000


@pytest.mark.parametrize("rule", ["lookup", "prune"], ids=["lookup", "prune"])
def test_keep_rule_stores_follow_the_suffix_rule_at_the_count_stores_bytes(
    db_dsn: str, tiny_dir: Path, tmp_path: Path, rule: str
) -> None:
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": PROMPTS[0]}])
    opts = AcceptOptions(
        corpus=(str(_corpus(tmp_path, tiny_dir)),),
        prompts=str(prompts),
        drafters=("none", "crest"),
        percents=(100.0,),
        top_t=(40,),
        keep=("count", "savings"),
        suffix_rule=rule,
        max_n=2,
        max_new_tokens=8,
        timing="none",
        check=0,
    )
    results = run_accept(opts, model=str(tiny_dir), dsn=db_dsn, out=tmp_path / "out", argv=["crest"])
    stores = {d["name"]: d for d in results["datastores"] if d["kind"] == "crest"}
    tag = "" if rule == "lookup" else f"_{rule}"
    assert set(stores) == {f"acc_custom_t40{tag}", f"acc_custom_savings_t40{tag}"}
    with psycopg.connect(db_dsn) as conn:
        params: dict[str, Any] = dict(
            conn.execute("SELECT name, params FROM crest_stores WHERE state = 'published'").fetchall()
        )
    count, savings = params[f"acc_custom_t40{tag}"], params[f"acc_custom_savings_t40{tag}"]
    assert savings["suffix_rule"] == count["suffix_rule"] == rule and savings["keep"] == "savings"
    assert savings["budget"] == stores[f"acc_custom_t40{tag}"]["nbytes"]  # equal bytes: the count store's


def test_hold_out_removes_whole_conversations(tmp_path: Path) -> None:
    from crest.bench.datastores import hold_out
    from crest.ingest.corpus import iter_documents
    from tests.fix_corpus import write_sharegpt

    records = [
        {
            "id": str(i),
            "conversations": [{"from": "human", "value": f"question {i}"}, {"from": "gpt", "value": f"a{i}"}],
        }
        for i in range(10)
    ]
    source = write_sharegpt(tmp_path / "chats.json", records)
    prompts = hold_out(source, tmp_path / "kept.jsonl", count=3, seed=7)
    assert len(prompts) == 3 and prompts == hold_out(source, tmp_path / "again.jsonl", count=3, seed=7)
    held = {p.split()[1] for p in prompts}
    docs = list(iter_documents([str(tmp_path / "kept.jsonl")], fmt="jsonl"))
    assert len(docs) == 2 * 7  # every turn of the seven kept conversations, one document each
    assert not any(d in (f"question {i}", f"a{i}") for d in docs for i in held)


def test_a_judge_key_follows_the_documents(tmp_path: Path) -> None:
    from crest.bench.datastores import judge_key

    judge = write_jsonl(tmp_path / "j.jsonl", [{"text": "one answer"}])
    first = judge_key([str(judge)])
    assert judge_key([str(judge)]) == first and len(first) == 8
    write_jsonl(judge, [{"text": "one answer"}, {"text": "and another"}])
    assert judge_key([str(judge)]) != first  # a changed judge names (and builds) another store
    assert judge_key([str(judge), str(judge)]) != judge_key([str(judge)])


def test_options_are_checked() -> None:
    with pytest.raises(ConfigError):
        AcceptOptions().validate()
    with pytest.raises(ConfigError):
        AcceptOptions(setting="code", drafters=("bogus",)).validate()
    with pytest.raises(ConfigError):
        AcceptOptions(setting="code", percents=(0.0,)).validate()


def test_added_and_weighted_inputs_join_the_preset_corpus(tmp_path: Path) -> None:
    from crest.bench.accept import prepare_corpus
    from crest.bench.datastores import stdlib_files

    answers = str(write_jsonl(tmp_path / "answers.jsonl", [{"text": "def f():\n    return 1"}]))
    base = prepare_corpus(AcceptOptions(setting="code"), tmp_path)
    once = prepare_corpus(AcceptOptions(setting="code", add_corpus=(answers,)), tmp_path)
    ten = prepare_corpus(AcceptOptions(setting="code", add_corpus=(answers,), weight=(f"{answers}=10",)), tmp_path)
    assert base.inputs == stdlib_files() and base.fmt == "files"
    assert once.inputs == [*base.inputs, answers] and once.fmt == "auto"  # each file read by its own format
    assert ten.inputs == [*base.inputs, *[answers] * 10]
    assert len({base.key, once.key, ten.key}) == 3  # each names (and builds) its own stores
    with pytest.raises(CorpusError, match="is not one of the inputs"):
        AcceptOptions(setting="code", weight=(f"{answers}=10",)).validate()
    with pytest.raises(ConfigError, match="read by their own format"):
        AcceptOptions(corpus=("c.json",), fmt="sharegpt", prompts="p.jsonl", add_corpus=(answers,)).validate()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--setting", "bogus"], "unknown setting"),
        (["--setting", "code", "--drafters", "none,nope"], "unknown drafter"),
        (["--setting", "code", "--sizes", "0"], "--sizes"),
        (["--setting", "code", "--timing", "sometimes"], "--timing"),
        ([], "--setting chat|code"),
        (["--setting", "code", "--suffix-judge", "j.jsonl"], "give --suffix-rule auto"),
    ],
    ids=["setting", "drafter", "sizes", "timing", "nothing", "judge-without-auto"],
)
def test_cli_rejects_bad_options(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path, args: list[str], message: str
) -> None:
    import sys

    from crest.cli.app import main

    monkeypatch.setattr(sys, "argv", ["crest", "bench", "accept", "--out", str(tmp_path), *args])
    with pytest.raises(SystemExit) as done:
        main()
    assert done.value.code == 2  # ConfigError
    assert message in capsys.readouterr().err
