"""The server learns from what it serves: real Postgres, a tiny random llama over the real SmolLM2 tokenizer.

A finished request writes its prompt's last max-n tokens and its output to its store's learned log unless the
server or the request says not to; a second server on the same database drafts the first one's outputs after
a refresh (the users ask twice: a live tier keeps the n-grams seen at least twice); a new server after a
restart reads the live tier; greedy output is the same with learning on and
off; refresh failures are counted and said once; the metrics count what was learned and refreshed. Each
learned row carries its request's figures, and the accepted tokens each draft part held are counted per step.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
import torch
from crest_client.draft import Draft
from crest_client.learner import STATS
from fastapi.testclient import TestClient

from crest.config import DEFAULT_LEARN_WINDOW, IngestOptions
from crest.decoding.sizing import CostModel
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.store import StoreDrafter
from crest.drafting.hub import LearnOptions
from crest.ingest.pipeline import ingest
from crest.learning.refresher import Refresher
from crest.learning.requests import PROMPT_TAIL, path_length, request_stats, served_tokens
from crest.serving.app import create_app
from crest.serving.engine import Engine
from crest.serving.metrics import ServerMetrics
from crest.serving.scheduler import Request, Scheduler
from tests.fix_models import tiny_model

pytest_plugins = ["tests.fix_corpus"]

CORPUS = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n" * 20
PROMPT = "def add(a, b):\n    return"
TAIL = PROMPT_TAIL  # prompt tokens a learned row keeps (PROMPT has fewer: all of it)
FLAT = CostModel([1, 64], [1.0, 1.0])  # drafting always pays: whole trees are verified
QUIET = LearnOptions(refresh_interval=3600, refresh_min_tokens=0, flush_interval=0.05)  # refreshes when told


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer: Any) -> Iterator[Any]:
    """A tiny random llama over the SmolLM2 vocabulary, on one torch thread (restored afterwards)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield tiny_model("llama", vocab=len(smollm2_tokenizer.hf), max_positions=2048, dtype=torch.float64)
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def code_dsn(db_dsn: str, smollm2_gguf: Path, tmp_path: Path) -> str:
    """A database holding the static store `code`, built from a small Python corpus."""
    corpus = tmp_path / "code.jsonl"
    corpus.write_text(json.dumps({"text": CORPUS}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="code", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=1000))
    return db_dsn


def engine(model: Any, tokenizer: Any, dsn: str, learning: LearnOptions | None, *, drafter: str = "crest") -> Engine:
    """Return a started engine serving store `code` (opened) with these learning options."""
    sched = Scheduler(model, tokenizer.hf, cost=FLAT, max_batch=4)
    found = Engine(sched, tokenizer.hf, model_name="tiny", store="code", drafter=drafter, dsn=dsn,
                   fingerprint=tokenizer.fingerprint, learning=learning)  # fmt: skip
    found.store("code")
    found.start()
    return found


def complete(found: Engine, prompt: list[int], *, max_tokens: int = 16, learn: bool = True, **kw: Any) -> Any:
    """Return the outcome of one greedy request through the engine."""
    job = found.request(prompt, drafter=kw.pop("drafter", None), store=None, prediction=None, max_tokens=max_tokens)
    future = found.submit(job, learn=learn)
    taught = threading.Event()  # done-callbacks run in order: this one after the engine's, which teaches the store
    future.add_done_callback(lambda _: taught.set())
    outcome = future.result(timeout=120)
    assert taught.wait(120), "the finished request was never handed to its store's learner"
    return outcome


def learned(dsn: str) -> list[tuple[list[int], int, str]]:
    """Return store `code`'s learned rows in id order: (token ids, prompt_tokens, source)."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT tokens, prompt_tokens, source FROM crest_learned WHERE store = 'code' ORDER BY id"
        ).fetchall()
    return [(np.frombuffer(t, dtype="<u4").tolist(), p, s) for t, p, s in rows]


def reference(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
    )
    return [int(t) for t in out[0, len(prompt) :]]


def live_next(found: Engine, context: list[int], *, wait: float = 0.0) -> list[int]:
    """Return the depth-1 tokens of the live tier's draft for the context ([] without one, after `wait` seconds)."""
    deadline = time.monotonic() + wait
    while True:
        parts = found.store("code").draft_parts(context, 64)  # seen within ~1 s; a lookup can miss (load)
        live = parts[1] if len(parts) > 1 else None
        if live is not None:
            return [int(t) for t, p in zip(live.tokens, live.parents, strict=True) if p == -1]
        if time.monotonic() >= deadline:
            return []
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("learning", "learn", "writes"),
    [(QUIET, True, True), (LearnOptions(record=False, refresh_interval=0), True, False), (QUIET, False, False)],
    ids=["on", "server-off", "request-off"],
)
def test_finished_requests_are_learned_unless_switched_off(
    tiny: Any, smollm2_tokenizer: Any, code_dsn: str, learning: LearnOptions, learn: bool, writes: bool
) -> None:
    prompt = smollm2_tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    found = engine(tiny, smollm2_tokenizer, code_dsn, learning)
    try:
        out = complete(found, prompt, learn=learn).result.output_token_ids
    finally:
        found.stop()  # writes what was queued
    want = [(prompt[-TAIL:] + out, len(prompt[-TAIL:]))] if writes else []
    assert [(ids, p) for ids, p, _ in learned(code_dsn)] == want
    assert all(source.startswith("serve@") for _, _, source in learned(code_dsn))


def test_cancelled_requests_teach_nothing(tiny: Any, smollm2_tokenizer: Any, code_dsn: str) -> None:
    found = engine(tiny, smollm2_tokenizer, code_dsn, QUIET)
    try:
        job = found.request([5, 6, 7], drafter=None, store=None, prediction=None, max_tokens=16)
        job.cancelled.set()
        assert found.submit(job).result(timeout=60).cancelled
        complete(found, [8, 9, 10], max_tokens=4)
    finally:
        found.stop()
    assert [ids[:3] for ids, _, _ in learned(code_dsn)] == [[8, 9, 10]]


def test_a_second_server_drafts_the_first_ones_outputs_after_a_refresh(
    tiny: Any, smollm2_tokenizer: Any, code_dsn: str
) -> None:
    prompt = smollm2_tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    first = engine(tiny, smollm2_tokenizer, code_dsn, QUIET)
    second = engine(tiny, smollm2_tokenizer, code_dsn, QUIET)
    try:
        out = complete(first, prompt, max_tokens=24).result.output_token_ids
        complete(first, prompt, max_tokens=24)  # asked again: a live tier keeps n-grams seen at least twice
        learner = first.learner("code")
        assert learner is not None and learner.flush(timeout=30)
        context = prompt + out[:6]
        with psycopg.connect(code_dsn) as conn:  # nothing live yet: no live tier at all, not a lookup that missed
            live = conn.execute("SELECT count(*) FROM crest_stores WHERE name = 'code' AND tier = 'live'").fetchone()
        assert live == (0,)
        assert second.store("code").live is None and live_next(second, context) == []
        assert second.refresher is not None and second.refresher.refresh_once() == {"code": "published"}
        with psycopg.connect(code_dsn) as conn:
            params = conn.execute(
                "SELECT params FROM crest_stores WHERE name = 'code' AND tier = 'live' AND state = 'published'"
            ).fetchone()
        assert params is not None and params[0]["tier"] == "live"
        assert out[6] in live_next(second, context, wait=60)  # the first server's next token, drafted by the second
        assert second.refresher.refresh_once() == {"code": "nothing"}  # nothing new learned since
    finally:
        first.stop()
        second.stop()


def test_learning_survives_a_restart(tiny: Any, smollm2_tokenizer: Any, code_dsn: str) -> None:
    prompt = smollm2_tokenizer.hf.encode("def sub(a, b):", add_special_tokens=False)
    before = engine(tiny, smollm2_tokenizer, code_dsn, QUIET)
    try:
        first = complete(before, prompt, max_tokens=24)
        out = first.result.output_token_ids
        complete(before, prompt, max_tokens=24)
        learner = before.learner("code")
        assert learner is not None and learner.flush(timeout=30)
        assert before.refresher is not None and before.refresher.refresh_once() == {"code": "published"}
    finally:
        before.stop()
    after = engine(tiny, smollm2_tokenizer, code_dsn, QUIET)  # a new process would open the store the same way
    try:
        assert out[8] in live_next(after, prompt + out[:8], wait=60)
        again = complete(after, prompt, max_tokens=24)
        assert again.result.output_token_ids == out
        assert again.accepted_draft_tokens > first.accepted_draft_tokens  # drafted from what was learned before
    finally:
        after.stop()


def test_greedy_output_is_the_same_with_learning_on_and_off(tiny: Any, smollm2_tokenizer: Any, code_dsn: str) -> None:
    prompts = [smollm2_tokenizer.hf.encode(p, add_special_tokens=False) for p in (PROMPT, "def sub(a", "x = [1, 2")]
    on = engine(tiny, smollm2_tokenizer, code_dsn, QUIET, drafter="crest+prompt")
    off = engine(tiny, smollm2_tokenizer, code_dsn, None, drafter="crest+prompt")
    wants = [reference(tiny, prompt, 20) for prompt in prompts]
    try:
        for prompt, want in zip(prompts * 2, wants * 2, strict=True):  # asked twice: the live tier keeps n-grams
            assert complete(on, prompt, max_tokens=20).result.output_token_ids == want  # seen at least twice
            assert complete(off, prompt, max_tokens=20).result.output_token_ids == want
        learner = on.learner("code")
        assert learner is not None and learner.flush(timeout=30)
        assert on.refresher is not None and on.refresher.refresh_once()["code"] != "failed"
        assert wants[0][8] in live_next(on, prompts[0] + wants[0][:8], wait=60)  # the store reads the new version
        live = 0
        for prompt, want in zip(prompts, wants, strict=True):  # the second round drafts from the live tier
            outcome = complete(on, prompt, max_tokens=20)
            assert outcome.result.output_token_ids == want
            assert complete(off, prompt, max_tokens=20).result.output_token_ids == want
            live += outcome.accepted_parts.get("live", 0)
        assert live > 0, "no accepted token came from the live tier"
        assert off.learner("code") is None and off.refresher is None
    finally:
        on.stop()
        off.stop()


def test_request_field_and_metrics_over_http(tiny: Any, smollm2_tokenizer: Any, code_dsn: str) -> None:
    sched = Scheduler(tiny, smollm2_tokenizer.hf, cost=FLAT)
    found = Engine(sched, smollm2_tokenizer.hf, model_name="tiny", store="code", drafter="crest", dsn=code_dsn,
                   fingerprint=smollm2_tokenizer.fingerprint, learning=QUIET)  # fmt: skip
    found.store("code")
    metrics = ServerMetrics()
    with TestClient(create_app(found, metrics=metrics)) as client:
        body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0}
        assert client.post("/v1/completions", json={**body, "learn": False}).status_code == 200
        assert client.post("/v1/completions", json={**body, "learn": True}).status_code == 200
        assert client.post("/v1/completions", json={**body, "learn": "sometimes"}).status_code == 400
        learner = found.learner("code")
        assert learner is not None and learner.flush(timeout=30)
        assert found.refresher is not None
        found.refresher.refresh_once()
        text = client.get("/metrics").text
    assert len(learned(code_dsn)) == 1
    prompt = smollm2_tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    assert f"crest_learned_tokens_total {float(len(prompt[-TAIL:]) + 5)}" in text
    assert "crest_learn_dropped_tokens_total 0.0" in text
    assert 'crest_live_refresh_total{result="published"} 1.0' in text
    assert 'crest_live_refresh_total{result="failed"} 0.0' in text


def test_refresh_failures_are_counted_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[str] = []
    refresher = Refresher("postgresql://u@127.0.0.1:1/db?connect_timeout=1", lambda: ["code", "chat"],
                          on_result=seen.append)  # fmt: skip
    caplog.set_level(logging.DEBUG, logger="crest.learning.refresher")
    assert refresher.refresh_once() == {"code": "failed", "chat": "failed"}
    assert refresher.refresh_once() == {"code": "failed", "chat": "failed"}
    assert seen == ["failed"] * 4 and refresher.counts["failed"] == 4
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


def test_a_refresher_with_interval_zero_never_starts() -> None:
    refresher = Refresher(None, lambda: ["code"], interval=0)
    refresher.start()
    refresher.stop()
    assert refresher.counts == {"published": 0, "nothing": 0, "failed": 0}


@pytest.mark.parametrize(
    ("prompt", "tail", "want"),
    [([1, 2, 3, 4, 5], 3, ([3, 4, 5, 9], 3)), ([1, 2], 4, ([1, 2, 9], 2)), ([1, 2], 0, ([9], 0))],
    ids=["long-prompt", "short-prompt", "no-context"],
)
def test_served_tokens_are_the_prompt_tail_and_the_output(
    prompt: list[int], tail: int, want: tuple[list[int], int]
) -> None:
    assert served_tokens(prompt, [9], tail=tail) == want
    long = list(range(100))
    assert served_tokens(long, [9]) == (long[-PROMPT_TAIL:] + [9], PROMPT_TAIL)  # a server's rows


def _crest(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    """Run `crest ARGS` through main(); return the exit code and stderr."""
    from crest.cli.app import main

    monkeypatch.setattr(sys, "argv", ["crest", *args])
    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main()
    return int(done.value.code or 0), capsys.readouterr().err


def test_serve_learning_options_and_their_variables(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: list[Any] = []
    monkeypatch.setattr("crest.serving.server.serve", lambda options, **kw: seen.append(options.learning))
    assert _crest(monkeypatch, capsys, "serve", "--store", "code")[0] == 0
    for key, value in {"CREST_LEARN": "false", "CREST_LEARN_WINDOW": "5000", "CREST_REFRESH_INTERVAL": "2.5",
                       "CREST_REFRESH_MIN_TOKENS": "7"}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    assert _crest(monkeypatch, capsys, "serve", "--store", "code")[0] == 0
    assert _crest(monkeypatch, capsys, "serve", "--store", "code", "--learn", "--refresh-interval", "0")[0] == 0
    picked = [(o.record, o.window, o.refresh_interval, o.refresh_min_tokens) for o in seen]
    assert picked == [
        (True, DEFAULT_LEARN_WINDOW, 10.0, 2048), (False, 5000, 2.5, 7), (True, 5000, 0.0, 7)
    ]  # fmt: skip


@pytest.mark.parametrize(
    "option", [["--learn-window", "0"], ["--refresh-interval", "-1"], ["--refresh-min-tokens", "-5"]],
    ids=["window", "interval", "min-tokens"],
)  # fmt: skip
def test_serve_refuses_bad_learning_options_before_loading_a_model(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], option: list[str]
) -> None:
    monkeypatch.setattr("crest.decoding.models.load_model", lambda *a, **kw: pytest.fail("loaded a model"))
    code, err = _crest(monkeypatch, capsys, "serve", "--drafter", "prompt", *option)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0 and len(lines) == 1 and option[0] in lines[0] and "Traceback" not in err


def chain(tokens: list[int], *, branch: int | None = None) -> Draft:
    """Return a chain of `tokens` (and a root child `branch` beside it) as a draft tree."""
    ids = [*tokens, *([] if branch is None else [branch])]
    parents = [*range(-1, len(tokens) - 1), *([] if branch is None else [-1])]
    return Draft(np.array(ids, dtype=np.int64), np.array(parents, dtype=np.int32), np.ones(len(ids), dtype=np.int64))


class Tiers:
    """A store with a live tier whose trees follow a known continuation: static holds 2 of its next tokens and a
    wrong branch, live 3 and then a wrong token."""

    live = True

    def __init__(self, prompt: list[int], want: list[int], vocab: int) -> None:
        self.start, self.want, self.vocab = len(prompt), want, vocab

    def draft_parts(self, context: list[int], max_nodes: int = 64) -> list[Draft | None]:
        """Return [static, live] trees for the context (a prefix of prompt + want)."""
        at = len(context) - self.start
        nxt = self.want[at : at + 4] + [0] * 4  # the continuation, padded past its end
        wrong = [(t + 1) % self.vocab for t in nxt]
        return [chain(nxt[:2], branch=wrong[0]), chain([*nxt[:3], wrong[3]])]


class NextToken(PromptDrafter):
    """A prompt part that drafts the continuation's next token only."""

    def __init__(self, tiers: Tiers) -> None:
        super().__init__()
        self.tiers = tiers

    def draft(self, context_ids: Any, max_nodes: int) -> Draft | None:
        """Return a one-node tree: the next token."""
        return chain(self.tiers.want[len(context_ids) - self.tiers.start :][:1])


def test_accepted_tokens_are_counted_per_part(tiny: Any, smollm2_tokenizer: Any) -> None:
    prompt = smollm2_tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    want = reference(tiny, prompt, 16)
    assert len(want) == 16
    tiers = Tiers(prompt, want, len(smollm2_tokenizer.hf))
    sched = Scheduler(tiny, smollm2_tokenizer.hf, max_draft_tokens=64)
    job = Request(prompt, max_tokens=16, drafter=MergedDrafter(StoreDrafter(tiers), NextToken(tiers)))
    future = sched.submit(job)
    while sched.step():
        pass
    outcome = future.result(timeout=0)
    assert outcome.result.output_token_ids == want
    # each step: 3 accepted (live's chain) and the target's next one; 4 steps for 16 tokens. Static held 2 of each
    # step's 3, the prompt part 1. Drafted: the merged 5 nodes a step, 4 in the last (its room is 3 deep).
    assert outcome.accepted_parts == {"static": 8, "live": 12, "prompt": 4}
    assert request_stats(outcome) == {
        "steps": 4, "new_tokens": 16, "draft_tokens": 19, "accepted_tokens": 12,
        "accepted_static": 8, "accepted_live": 12, "accepted_prompt": 4,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "want"), [([5, 6, 7], 2), ([5, 9], 1), ([8], 1), ([6], 0), ([], 0)],
    ids=["chain-then-miss", "first-only", "branch", "not-at-root", "nothing"],
)  # fmt: skip
def test_path_length_counts_the_leading_tokens_a_tree_holds(tokens: list[int], want: int) -> None:
    assert path_length(chain([5, 6], branch=8), tokens) == want


def test_learned_rows_carry_their_requests_figures(tiny: Any, smollm2_tokenizer: Any, code_dsn: str) -> None:
    prompt = smollm2_tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    found = engine(tiny, smollm2_tokenizer, code_dsn, QUIET, drafter="crest+prompt")
    try:
        outcomes = [complete(found, prompt, max_tokens=24) for _ in range(2)]  # twice: the live tier keeps them
        learner = found.learner("code")
        assert learner is not None and learner.flush(timeout=30)
        assert found.refresher is not None and found.refresher.refresh_once() == {"code": "published"}
        assert live_next(found, prompt, wait=60)  # the store follows the new live version
        outcomes.append(complete(found, prompt, max_tokens=24))
        assert learner.flush(timeout=30)
    finally:
        found.stop()
    with psycopg.connect(code_dsn) as conn:
        query = f"SELECT {', '.join(STATS)}, accepted_parts FROM crest_learned WHERE store = 'code' ORDER BY id"
        rows = conn.execute(query).fetchall()
    figures = [
        dict(zip(STATS, row[:-1], strict=True)) | {f"accepted_{k}": v for k, v in row[-1].items()} for row in rows
    ]
    # the request's figures, and the parts that held an accepted token (accepted_parts keeps no zeros)
    assert figures == [{k: v for k, v in request_stats(o).items() if v or k in STATS} for o in outcomes]
    first, last = figures[0], figures[-1]
    assert first["steps"] == outcomes[0].result.forward_passes > 0 and first["new_tokens"] == 24
    assert first.get("accepted_live", 0) == 0  # no live tier yet
    assert last.get("accepted_live", 0) > 0  # drafted what it learned
    assert last["accepted_tokens"] > first["accepted_tokens"]
    for row in figures:  # every accepted token was held by some part, and no part held more than was accepted
        parts = [v for k, v in row.items() if k not in STATS] or [0]
        assert max(parts) <= row["accepted_tokens"] <= sum(parts)


@pytest.mark.parametrize("drafter", ["prompt", "none", "crest+prompt"])
def test_a_request_teaches_the_store_it_names_whatever_its_drafter(
    tiny: Any, smollm2_tokenizer: Any, code_dsn: str, smollm2_gguf: Path, tmp_path: Path, drafter: str
) -> None:
    """{"store": "other", "drafter": "prompt"} teaches `other`, not the server's store, whatever it drafts from."""
    corpus = tmp_path / "other.jsonl"
    corpus.write_text(json.dumps({"text": CORPUS.replace("add", "mul")}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="other", tokenizer=str(smollm2_gguf), dsn=code_dsn, options=IngestOptions(top_t=100))
    prompt = smollm2_tokenizer.hf.encode(PROMPT, add_special_tokens=False)
    found = engine(tiny, smollm2_tokenizer, code_dsn, LearnOptions(refresh_interval=0))
    try:
        job = found.request(prompt, drafter=drafter, store="other", prediction=None, max_tokens=8)
        assert job.store == "other" and bool(job.parts) == (drafter == "crest+prompt")
        out = found.submit(job).result(timeout=120).result.output_token_ids
    finally:
        found.stop()  # writes what was queued
    with psycopg.connect(code_dsn) as conn:
        rows = conn.execute("SELECT store, tokens FROM crest_learned ORDER BY id").fetchall()
    assert [(store, np.frombuffer(t, dtype="<u4").tolist()) for store, t in rows] == [("other", prompt[-TAIL:] + out)]
