"""crest inside vLLM (crest.integrations): the best chain of a tree, `CrestProposer` driven step by step as vLLM's
model runner drives it (fast, real PostgreSQL), and a real vLLM serving SmolLM2 with the proposer (slow).

The fast tests stand in for vLLM's model runner with `Runner`: it holds the batch as vLLM does (`input_batch`,
`requests`), calls `propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)` from its
`propose_draft_token_ids(scheduler_output, ...)`, and plays a target model that follows a known text, so it
accepts the longest right prefix of each chain plus one token, as greedy verification does. The slow tests need
a Python with vLLM (`CREST_VLLM_PYTHON`, else /work/venvs/vllm/bin/python; see .ci/vllm-venv) and are skipped,
saying so, without one.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client.draft import Draft, path_probabilities

from crest.config import IngestOptions, VllmSettings, vllm_settings
from crest.errors import ConfigError
from crest.ingest.pipeline import ingest
from crest.integrations.chain import best_chain
from crest.integrations.vllm import CrestProposer
from tests.fix_proxy import Proxy
from tests.fix_vllm import (
    MAX_TOKENS,
    REQUEST_TIMEOUT,
    K,
    Runner,
    VllmServer,
    required_vllm_python,
    vllm_config,
    vllm_python,
)

pytest_plugins = ["tests.fix_corpus"]

TEXT = "the cat sat on the mat a dog sat on a mat the dog sat on the cat a mat"


def _tree(tokens: list[int], parents: list[int], weights: list[int]) -> Draft:
    return Draft(np.array(tokens, np.int64), np.array(parents, np.int32), np.array(weights, np.int64))


def test_best_chain_takes_the_path_with_most_expected_tokens() -> None:
    # root children 10 (w 6) and 20 (w 4); under 10 a split 11 (3) / 12 (3), under 20 a sure chain 21 -> 22
    tree = _tree([10, 20, 11, 12, 21, 22], [-1, -1, 0, 0, 1, 4], [6, 4, 3, 3, 4, 4])
    chain = best_chain(tree, depth=3)
    assert chain.tokens.tolist() == [20, 21, 22] and chain.parents.tolist() == [-1, 0, 1]
    probs = path_probabilities(tree)
    np.testing.assert_allclose(path_probabilities(chain), probs[[1, 4, 5]])  # the root total is kept
    assert best_chain(tree, depth=1).tokens.tolist() == [10]  # one node: the likeliest first token
    assert len(best_chain(tree, depth=0)) == 0 and len(best_chain(None, depth=4)) == 0


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture
def words_store(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> str:
    """A store `words` built from TEXT many times over, with the word tokenizer."""
    corpus = tmp_path / "words.jsonl"
    corpus.write_text(json.dumps({"text": " ".join([TEXT] * 20)}) + "\n", encoding="utf-8")
    options = IngestOptions(top_t=500)
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=options)
    return db_dsn


def _requests(word_tokenizer_dir: Path) -> list[tuple[str, list[int], list[int]]]:
    from transformers import AutoTokenizer

    ids = _ids(AutoTokenizer.from_pretrained(str(word_tokenizer_dir)), TEXT)
    return [("a", ids[:3], ids[3:14]), ("b", ids[5:9], ids[9:20])]


def test_proposer_drafts_from_the_store_and_teaches_it(words_store: str, word_tokenizer_dir: Path) -> None:
    settings = VllmSettings(store="words", drafter="crest", dsn=words_store, read_dsn=words_store)
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=settings)
    runner = Runner(proposer)
    requests = _requests(word_tokenizer_dir)
    for req_id, prompt, output in requests:
        runner.add(req_id, prompt, output)
    runner.run()
    assert proposer.name == "crest" and runner.drafted and runner.accepted > 0
    assert runner.steps < sum(len(o) for _, _, o in requests) / 2 + 3  # chains accepted: fewer steps than tokens
    assert not proposer._rows  # vLLM dropped both requests: so did the proposer
    assert proposer.learner is not None and proposer.learner.flush(timeout=10)
    with psycopg.connect(words_store) as conn:
        rows = conn.execute(
            "SELECT tokens, prompt_tokens, source, new_tokens, accepted_tokens FROM crest_learned ORDER BY id"
        ).fetchall()
    taught = sorted(np.frombuffer(t, "<u4").tolist() for t, *_ in rows)
    max_n = IngestOptions().max_n
    assert taught == sorted(p[-max_n:] + o for _, p, o in requests)
    assert all(src.startswith("vllm@") and new == 11 and acc > 0 for _, _, src, new, acc in rows)
    proposer.close()


@pytest.mark.parametrize("every", [1e-9, 3600.0, 0.0], ids=["every-step", "at-close", "off"])
def test_proposer_says_its_drafts_and_the_stores_lookups(
    words_store: str, word_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture, every: float
) -> None:
    settings = VllmSettings(
        store="words", drafter="crest", dsn=words_store, read_dsn=words_store, learn=False, report_interval=every
    )
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=settings)
    runner = Runner(proposer)
    for req_id, prompt, output in _requests(word_tokenizer_dir):
        runner.add(req_id, prompt, output)
    with caplog.at_level(logging.INFO, logger="crest.integrations.vllm"):
        runner.run()
        said_before_close = len(caplog.records)
        proposer.close()
    line = re.compile(
        r"crest proposer, last \d+ s: (\d+) steps, (\d+) draft tokens verified, (\d+) accepted \(\d+%\); "
        r"since start (\d+) verified, (\d+) accepted; proposer time per step p50 [\d.]+ ms, p99 [\d.]+ ms "
        r"\([\d.]+ ms per row; CPU p50 [\d.]+ ms\); (\d+) lookups rested \(not worth their CPU\); "
        r"(\d+) of (\d+) chain tokens kept by the cost curve; "
        r"store lookups (\d+) \(cache hits (\d+), past the timeout (\d+), failed (\d+)\)"
        r"(?:; a step of 1 / \d+ / \d+ / \d+ tokens costs [\d.]+ / [\d.]+ / [\d.]+ / [\d.]+ ms \(learned\))?"
        r"(?:; draft nodes predicted:accepted [\d.]+:[\d.]+(?: [\d.]+:[\d.]+)* \(learned\))?"
        r"(?:; other replicas' rows fed \d+ \(\d+ notifications\))?"  # a single process: none
    )
    found = [[int(x) for x in m.groups()] for m in map(line.fullmatch, caplog.messages) if m]
    totals = [sum(column) for column in zip(*found, strict=True)]
    if every == 0:  # CREST_REPORT_INTERVAL=0: no lines
        assert found == []
        return
    every_step = every < 1
    assert len(found) == (runner.steps if every_step else 1) and said_before_close == (len(found) if every_step else 0)
    steps, drafted, accepted, _, _, rested, kept, chosen, lookups, _, timeouts, failed = totals
    assert drafted <= kept <= chosen and kept > 0  # every verified chain token was one the cost curve kept
    assert (steps, drafted, accepted) == (runner.steps, runner.drafted, runner.accepted), totals
    assert rested == proposer.gate.rested
    assert found[-1][3:5] == [runner.drafted, runner.accepted]  # since start: what vLLM's counters say
    assert lookups > 0 and timeouts == failed == 0
    widths = " / ".join(str(t) for t in (1, 1 + K // 4, 1 + K // 2, 1 + K))  # no draft, K/4, K/2 and K draft tokens
    costs = re.search(rf"a step of {widths} tokens costs ([\d.]+) / ([\d.]+) / ([\d.]+) / ([\d.]+) ms", caplog.text)
    assert costs is not None, caplog.text  # what the proposer learned a step costs
    assert 0 < float(costs.group(1)) <= float(costs.group(4))
    bands = re.findall(r"draft nodes predicted:accepted ([\d.: ]+) \(learned\)", caplog.text)
    assert bands, caplog.text  # how often the chains' nodes were accepted, by their predicted probability
    pairs = [tuple(map(float, b.split(":"))) for b in bands[-1].split()]
    assert all(0 < p <= 1 and 0 <= a <= 1 for p, a in pairs) and any(a > 0 for _, a in pairs)


def test_crest_logs_through_vllms_handlers_when_vllm_has_them(monkeypatch: pytest.MonkeyPatch) -> None:
    from crest.integrations._report import log_with_vllm

    names = ("vllm", "crest", "crest_client")
    for name in names:  # restored afterwards: handlers, level, propagation
        logger = logging.getLogger(name)
        monkeypatch.setattr(logger, "handlers", [])
        monkeypatch.setattr(logger, "propagate", True)
        monkeypatch.setattr(logger, "level", logging.NOTSET)
    log_with_vllm()  # vLLM not configured (or not there): nothing changes
    assert not logging.getLogger("crest").handlers and logging.getLogger("crest").propagate
    handler = logging.StreamHandler()
    logging.getLogger("vllm").addHandler(handler)
    logging.getLogger("vllm").setLevel(logging.INFO)
    log_with_vllm()
    for name in ("crest", "crest_client"):
        ours = logging.getLogger(name)
        assert ours.handlers == [handler] and not ours.propagate and ours.getEffectiveLevel() == logging.INFO
    log_with_vllm()  # once: a second proposer in the process adds nothing
    assert logging.getLogger("crest").handlers == [handler]


def test_requests_still_held_when_steps_stop_are_learned(words_store: str, word_tokenizer_dir: Path) -> None:
    settings = VllmSettings(store="words", drafter="crest", dsn=words_store, read_dsn=words_store, refresh_interval=0)
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=settings, idle_learn=0.3)
    runner = Runner(proposer)
    requests = _requests(word_tokenizer_dir)
    for req_id, prompt, output in requests:
        runner.add(req_id, prompt, output)
    try:
        for _ in range(2):  # then no step: vLLM calls no proposer once its batch is done (or the engine idles)
            runner.step()
        held = {r: list(runner.tokens[r]) for r, *_ in requests}
        assert set(proposer._rows) == set(held) and not any(row.learned for row in proposer._rows.values())
        rows: list[Any] = []
        deadline = time.monotonic() + 60
        while len(rows) < len(requests):
            assert time.monotonic() < deadline, rows
            assert proposer.learner is not None and proposer.learner.flush(timeout=10)
            with psycopg.connect(words_store) as conn:
                rows = conn.execute("SELECT tokens, new_tokens FROM crest_learned").fetchall()
            time.sleep(0.1)
        max_n = IngestOptions().max_n
        taught = sorted((np.frombuffer(t, "<u4").tolist(), new) for t, new in rows)
        want = sorted((held[r][max(0, len(p) - max_n) :], len(held[r]) - len(p)) for r, p, _ in requests)
        assert taught == want  # what each had served when the steps stopped, once
    finally:
        proposer.close()
    with psycopg.connect(words_store) as conn:  # close() does not learn them a second time
        assert conn.execute("SELECT count(*) FROM crest_learned").fetchone() == (len(requests),)


def test_proposer_chains_stay_within_k_and_the_room_left(words_store: str, word_tokenizer_dir: Path) -> None:
    settings = VllmSettings(store="words", drafter="crest+prompt", read_dsn=words_store, learn=False)
    proposer = CrestProposer(vllm_config(word_tokenizer_dir, k=2, max_len=16), settings=settings)
    runner = Runner(proposer, width=16)
    prompt = _requests(word_tokenizer_dir)[0][1]
    runner.add("a", prompt, _requests(word_tokenizer_dir)[0][2])
    try:
        runner.run()
    finally:
        proposer.close()  # its store: left open, it warns (a failure in this suite)
    seen = runner.seen
    assert max(n for _, n in seen) == 2 and runner.accepted > 0
    # a chain of n tokens yields up to n + 1: never past the model's positions, nor past max_tokens
    assert all(n == 0 or length + n + 1 <= min(16, len(prompt) + 11) for length, n in seen), seen
    assert any(length + n + 1 == len(prompt) + 11 for length, n in seen), seen  # up to the last token wanted
    assert proposer.learner is None


def test_proposer_serves_on_while_the_database_is_down(
    words_store: str, word_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proxy, dsn = Proxy.fronting(words_store)
    proxy.up()
    try:
        settings = VllmSettings(store="words", drafter="crest+prompt", dsn=dsn, read_dsn=dsn)
        proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=settings)
        runner = Runner(proposer)
        (req_id, prompt, output), second = _requests(word_tokenizer_dir)
        runner.add(req_id, prompt, output)
        for _ in range(2):
            runner.step()
        assert runner.drafted
        proxy.down()  # mid-request: lookups fail, the learner cannot write
        steps, drafted, accepted = runner.steps, runner.drafted, runner.accepted
        with caplog.at_level(logging.WARNING):
            runner.add(*second)
            runner.run()
        assert not runner.tokens and not proposer._rows  # both requests ran to their end
        # the target's output is fixed by the stand-in: what the proposer decides is whether it drafts on. The
        # store's part is gone, the prompt's goes on: drafts accepted, fewer steps than tokens
        assert runner.accepted > accepted and runner.drafted > drafted, (drafted, runner.drafted, runner.accepted)
        assert runner.steps - steps < len(second[2]) + 1, (steps, runner.steps)
        assert "crest proposer failed" not in caplog.text  # the faults were absorbed below the proposer
        proposer.close()
    finally:
        proxy.down()
    # a database down from the start: the store is pending, prompt lookup still drafts
    settings = VllmSettings(store="words", drafter="crest+prompt", dsn=dsn, read_dsn=dsn)
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=settings)
    runner = Runner(proposer)
    runner.add(req_id, prompt + prompt, output)
    runner.run()
    assert runner.drafted and not runner.tokens
    proposer.close()


def test_proposer_never_raises_into_vllm(word_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=VllmSettings(drafter="prompt", learn=False))
    with caplog.at_level(logging.WARNING):
        drafts = proposer.propose([[3], [4]], np.array([5, 9]), np.zeros((1, 3), np.int32))  # rows do not match
    assert drafts == [[], []] and "crest proposer failed" in caplog.text


def test_proposer_settings(words_store: str, word_tokenizer_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = vllm_config(word_tokenizer_dir)
    with pytest.raises(ConfigError, match="unknown drafter"):
        CrestProposer(config, settings=VllmSettings(drafter="rest"))  # a REST index lives in one process
    with pytest.raises(ConfigError, match="set CREST_STORE"):
        CrestProposer(config, settings=VllmSettings(drafter="crest"))
    with caplog.at_level(logging.WARNING):
        missing = CrestProposer(config, settings=VllmSettings(store="nothing", read_dsn=words_store))
    assert missing.name == "prompt" and missing.learner is None and "cannot be used" in caplog.text
    alone = CrestProposer(config, settings=VllmSettings(store="nothing", drafter="crest", read_dsn=words_store))
    assert alone.name == "none" and alone.propose([[3]], np.array([4]), np.array([[2, 3, 4, 3]])) == [[]]
    assert CrestProposer(config, settings=VllmSettings()).name == "prompt"
    env = {"CREST_STORE": "code", "CREST_DRAFTER": "Crest", "CREST_LEARN": "off", "CREST_DATABASE_URL": "x"}
    assert vllm_settings(env) == VllmSettings(store="code", drafter="crest", learn=False, dsn="x")
    assert vllm_settings({}) == VllmSettings()
    with pytest.raises(ConfigError, match="CREST_LEARN"):
        vllm_settings({"CREST_LEARN": "maybe"})
    env = {"CREST_REFRESH_INTERVAL": "2.5", "CREST_REFRESH_MIN_TOKENS": "0", "CREST_LEARN_WINDOW": "1000"}
    env["CREST_REPORT_INTERVAL"] = "0"
    assert vllm_settings(env) == VllmSettings(
        refresh_interval=2.5, refresh_min_tokens=0, learn_window=1000, report_interval=0.0
    )
    for name, bad in [("CREST_REFRESH_INTERVAL", "soon"), ("CREST_REFRESH_INTERVAL", "-1"),
                      ("CREST_REFRESH_INTERVAL", "nan"), ("CREST_REFRESH_MIN_TOKENS", "1.5"),
                      ("CREST_LEARN_WINDOW", "0"), ("CREST_REPORT_INTERVAL", "-5")]:  # fmt: skip
        with pytest.raises(ConfigError, match=name):
            vllm_settings({name: bad})


def test_a_second_replica_drafts_what_the_first_served_once_its_refresher_ran(
    words_store: str, word_tokenizer_dir: Path
) -> None:
    from transformers import AutoTokenizer

    ids = _ids(AutoTokenizer.from_pretrained(str(word_tokenizer_dir)), TEXT)[::-1]  # an order the corpus never had
    prompt, output = ids[:3], ids[3:18]

    def serve(settings: VllmSettings, *names: str) -> tuple[CrestProposer, Runner]:
        proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=settings)
        runner = Runner(proposer)
        for name in names:
            runner.add(name, prompt, output)
        runner.run()
        return proposer, runner

    common: dict[str, Any] = dict(store="words", drafter="crest", dsn=words_store, read_dsn=words_store)
    alone, before = serve(VllmSettings(**common, learn=False, refresh_interval=0), "x")
    assert alone.refresher is None
    alone.close()
    first, _ = serve(VllmSettings(**common, refresh_interval=0.1, refresh_min_tokens=0), "a", "b")  # min count 2
    assert first.learner is not None and first.learner.flush(timeout=30) and first.refresher is not None
    rounds = sum(first.refresher.counts.values())
    deadline = time.monotonic() + 120
    while sum(first.refresher.counts.values()) < rounds + 2:  # a whole refresh begun after both rows were written
        assert time.monotonic() < deadline, first.refresher.counts
        time.sleep(0.05)
    assert first.refresher.counts["published"] >= 1 and first.refresher.counts["failed"] == 0
    first.close()
    second, after = serve(VllmSettings(**common, learn=False, refresh_interval=0), "c")
    second.close()
    assert after.accepted > before.accepted and after.steps < before.steps, (before.accepted, after.accepted)


# --- a real vLLM (slow): SmolLM2 exported by crest, served without speculation, then with crest's proposer ---

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n\ndef main():",
    "class Stack:\n    def __init__(self):",
    "def is_prime(n):",
    'def read_json(path):\n    """Read a JSON file and return its content."""',
    "# Sort a list of numbers\ndef bubble_sort(items):",
]
# pytest-timeout counts a test function only (pyproject.toml): the fixtures bound their own waits (VllmServer's
# START_TIMEOUT, REQUEST_TIMEOUT), each test its own, every one of them shorter than the 600 s a test may take
TAUGHT = 3  # the store holds the no-speculation outputs of the first TAUGHT prompts (the others: wrong drafts)


@pytest.fixture(scope="module")
def served(pg_server: str, tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Any:
    """vLLM's greedy texts without speculation, then a vLLM serving with CrestProposer (drafter crest) on a store
    of some of those texts, its database reached through a proxy that a test can switch off."""
    import uuid

    from psycopg import sql

    from crest.db.versions import upgrade
    from crest.decoding.export import export_hf

    python = required_vllm_python()
    root = tmp_path_factory.mktemp("vllm")
    model = export_hf("smollm2", root / "smollm2")
    plain = VllmServer(python, model, root / "plain.log", spec=None, env={})
    try:
        plain.wait_ready()
        baseline = plain.complete(PROMPTS)
    finally:
        plain.stop()
    name = f"crest_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(pg_server, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(pg_server)
    dsn = psycopg.conninfo.make_conninfo(**{**{k: str(v) for k, v in info.items()}, "dbname": name})
    upgrade(dsn)
    corpus = root / "taught.jsonl"
    records = [json.dumps({"text": p + t}) for p, t in list(zip(PROMPTS, baseline, strict=True))[:TAUGHT]]
    corpus.write_text("\n".join(records * 5) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="taught", tokenizer=str(smollm2_gguf), dsn=dsn, options=IngestOptions(top_t=5000))
    proxy, proxied = Proxy.fronting(dsn)
    proxy.up()
    env = {"CREST_STORE": "taught", "CREST_DRAFTER": "crest", "CREST_LEARN": "1"}
    env |= {"CREST_DATABASE_URL": proxied, "CREST_READ_DATABASE_URL": proxied}
    # lookups through the proxy on a loaded machine (a neighbour's disk writes) can outrun the 10 ms default and
    # draft nothing; these tests are about the drafts, the deadline has its own (tests/test_faults.py)
    env["CREST_LOOKUP_TIMEOUT"] = "0.5"
    env["CREST_REPORT_INTERVAL"] = "1"  # the proposer's figures in the log every second of steps
    spec = {"method": "custom_class", "model": "crest.integrations.vllm.CrestProposer", "num_speculative_tokens": K}
    server = VllmServer(python, model, root / "crest.log", spec=spec, env=env)
    try:
        server.wait_ready()
        yield SimpleNamespace(server=server, baseline=baseline, proxy=proxy, dsn=dsn)
    finally:
        server.stop()
        proxy.down()
        with psycopg.connect(pg_server, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


@pytest.mark.slow
def test_vllm_with_crest_is_exact_and_accepts_store_drafts(served: Any) -> None:
    import time

    before = served.server.counters()
    texts = served.server.complete(PROMPTS)
    assert texts == served.baseline  # greedy: token for token what vLLM gives without speculation
    # crest's INFO lines reach vLLM's log (through vLLM's handlers): its settings, then its figures
    logged = served.server.log.read_text(errors="replace")
    assert "crest proposer: drafter crest, store taught" in logged
    assert re.search(r"crest proposer, last \d+ s: \d+ steps, .* accepted .*; store lookups [1-9]", logged), logged[
        -3000:
    ]
    after = served.server.counters()
    drafted = after["draft_tokens_total"] - before.get("draft_tokens_total", 0.0)
    accepted = after["accepted_tokens_total"] - before.get("accepted_tokens_total", 0.0)
    # drafter crest: every draft is the store's (the server's log says why, should it draft little)
    assert drafted > 0 and accepted >= 10, (drafted, accepted, served.server.tail(60))
    deadline = time.monotonic() + REQUEST_TIMEOUT  # the proposer's learner writes in the background: slow under load
    rows: list[Any] = []
    while time.monotonic() < deadline and len(rows) < len(PROMPTS):  # each finished request teaches the store
        with psycopg.connect(served.dsn) as conn:
            rows = conn.execute("SELECT source, new_tokens, accepted_tokens FROM crest_learned").fetchall()
        time.sleep(0.5)
    assert len(rows) >= len(PROMPTS) and all(src.startswith("vllm@") and new == MAX_TOKENS for src, new, _ in rows)
    assert sum(acc for *_, acc in rows) > 0


@pytest.mark.slow
def test_vllm_serves_on_when_the_database_goes_down(served: Any) -> None:
    served.proxy.down()
    try:
        assert served.server.complete(PROMPTS) == served.baseline  # no drafts from the store, the same text
        assert served.server.complete(PROMPTS[:2]) == served.baseline[:2]
        assert served.server.proc.poll() is None and "Traceback" not in served.server.tail(400)
    finally:
        served.proxy.up()


@pytest.fixture(scope="module")
def served_dense(served: Any, smollm2_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A vLLM serving with CrestProposer (drafter dense) on a store whose dense part holds some of vLLM's texts."""
    from crest.ingest.dense import DenseOptions

    python = vllm_python()
    assert python is not None  # `served` skipped otherwise
    root = tmp_path_factory.mktemp("vllm-dense")
    corpus = root / "taught.jsonl"
    records = [json.dumps({"text": p + t}) for p, t in list(zip(PROMPTS, served.baseline, strict=True))[:TAUGHT]]
    corpus.write_text("\n".join(records * 5) + "\n", encoding="utf-8")
    dense = DenseOptions(str(smollm2_gguf), positions=10_000)
    options = IngestOptions(top_t=5000)
    tokenizer = str(smollm2_gguf)
    ingest([str(corpus)], store="taught_dense", tokenizer=tokenizer, dsn=served.dsn, options=options, dense=dense)
    env = {"CREST_STORE": "taught_dense", "CREST_DRAFTER": "dense", "CREST_LEARN": "0"}
    env |= {"CREST_DATABASE_URL": served.dsn, "CREST_READ_DATABASE_URL": served.dsn}
    spec = {"method": "custom_class", "model": "crest.integrations.vllm.CrestProposer", "num_speculative_tokens": K}
    server = VllmServer(python, Path(served.server.model), root / "dense.log", spec=spec, env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_vllm_with_the_dense_drafter_is_exact_and_accepts_its_drafts(served: Any, served_dense: Any) -> None:
    texts = served_dense.complete(PROMPTS)
    assert texts == served.baseline  # greedy: token for token what vLLM gives without speculation
    counters = served_dense.counters()
    # drafter dense: every draft came from the neighbours of vLLM's own hidden states, read from its runner
    assert counters.get("draft_tokens_total", 0) > 0 and counters.get("accepted_tokens_total", 0) >= 10, counters
    assert "Traceback" not in served_dense.tail(400)


@pytest.mark.parametrize(("installed", "warned"), [("0.32.0", False), ("0.40.1", True)], ids=["tested", "newer"])
def test_a_vllm_release_the_runner_reading_was_not_tested_on_is_said(
    installed: str, warned: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import importlib.metadata

    from crest.integrations._vllm_runner import check_vllm_version

    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed)
    with caplog.at_level(logging.WARNING, logger="crest.integrations._vllm_runner"):
        assert check_vllm_version() == installed
    assert ("not a release crest's proposer was tested with" in caplog.text) == warned
