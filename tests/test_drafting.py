"""The drafting hub (crest.drafting) and its recent tier, driven through the vLLM proposer as vLLM's runner drives it:
a response drafts the next request at once, another replica's within about a second (the learned feed), a
restarted replica is warmed from the log, rows committed out of id order are fed once, a preempted request is
learned once and a tensor-parallel rank other than 0 learns nothing (real PostgreSQL)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import psycopg
import pytest
from crest_client.draft import Draft

from crest.config import IngestOptions, VllmSettings
from crest.drafters.recent import RecentIndex
from crest.drafting.hub import DraftHub, LearnOptions
from crest.ingest.pipeline import ingest
from crest.integrations.vllm import CrestProposer
from crest.learning.feed import LearnedFeed
from crest.learning.journal import append_learned
from tests.fix_vllm import K, Runner, vllm_config
from tests.fix_wait import wait_until

pytest_plugins = ["tests.fix_corpus", "tests.fix_serving"]

TEXT = "the cat sat on the mat a dog sat on a mat the dog sat on the cat a mat"


@pytest.fixture
def words(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> str:
    """A store `words` built from TEXT many times over (the word tokenizer); its DSN."""
    corpus = tmp_path / "words.jsonl"
    corpus.write_text(json.dumps({"text": " ".join([TEXT] * 20)}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn,
           options=IngestOptions(top_t=500))  # fmt: skip
    return db_dsn


@pytest.fixture
def novel(word_tokenizer_dir: Path) -> tuple[list[int], list[int]]:
    """A prompt and an output in an order the corpus never had (the store alone drafts them poorly)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(word_tokenizer_dir))
    ids = [int(t) for t in tokenizer.encode(TEXT, add_special_tokens=False)][::-1]
    return ids[:3], ids[3:20]


def _settings(dsn: str, **kw: Any) -> VllmSettings:
    common: dict[str, Any] = dict(store="words", drafter="crest", dsn=dsn, read_dsn=dsn, refresh_interval=0)
    return VllmSettings(**(common | kw))


def _serve(proposer: CrestProposer, prompt: list[int], output: list[int], name: str) -> Runner:
    runner = Runner(proposer)
    runner.add(name, prompt, output)
    runner.run()
    return runner


def _learned(dsn: str) -> list[tuple[list[int], str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT tokens, source FROM crest_learned ORDER BY id").fetchall()
    return [(np.frombuffer(t, "<u4").tolist(), s) for t, s in rows]


@pytest.mark.parametrize("recent", [True, False], ids=["recent-tier", "no-recent-tier"])
def test_a_response_drafts_the_next_request_at_once(
    words: str, word_tokenizer_dir: Path, novel: tuple[list[int], list[int]], recent: bool
) -> None:
    prompt, output = novel
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=_settings(words, recent=recent))
    try:
        first = _serve(proposer, prompt, output, "a")
        second = _serve(proposer, prompt, output, "b")  # right after: no refresh, nothing polled
    finally:
        proposer.close()
    if recent:  # every chain of the second request is the first one's answer: all accepted, K + 1 tokens a step
        assert second.accepted == second.drafted >= len(output) - 1 - K, (second.drafted, second.accepted)
        assert second.accepted > first.accepted and second.steps < first.steps
    else:
        assert second.accepted == first.accepted  # the store alone: the same drafts both times


def test_another_replica_drafts_it_within_a_second_and_a_restart_keeps_it(
    words: str, word_tokenizer_dir: Path, novel: tuple[list[int], list[int]]
) -> None:
    prompt, output = novel
    config = vllm_config(word_tokenizer_dir)
    other = CrestProposer(config, settings=_settings(words, learn=False, feed_interval=0.05))
    first = CrestProposer(config, settings=_settings(words))
    try:
        before = other.hub.recent("words")
        assert before is not None and before.documents == 0
        _serve(first, prompt, output, "a")
        assert first.learner is not None and first.learner.flush(timeout=30)
        wait_until(lambda: before.documents == 1, "the other replica's feed never brought the learned row")
        served = _serve(other, prompt, output, "b")
        assert served.accepted == served.drafted >= len(output) - 1 - K, served.accepted
    finally:
        first.close()
        other.close()
    restarted = CrestProposer(config, settings=_settings(words, learn=False))  # a new process: warmed from the log
    try:
        wait_until(lambda: restarted.hub.recent("words").documents == 1, "not warmed")
        warmed = _serve(restarted, prompt, output, "c")
        assert warmed.accepted == warmed.drafted >= len(output) - 1 - K
    finally:
        restarted.close()


def test_rows_committed_out_of_id_order_are_fed_once(words: str) -> None:
    index = RecentIndex()
    feed = LearnedFeed(words, lambda: [("words", index)], source="me")
    late = psycopg.connect(words)
    try:
        assert feed.poll() == 0
        late.execute("INSERT INTO crest_learned (store, tokens, n_tokens) VALUES ('words', %s, 3)",
                     (np.array([2, 3, 4], "<u4").tobytes(),))  # fmt: skip  # an id taken, not yet committed
        append_learned(words, "words", [[5, 6, 7, 8]])  # a later id, committed first
        append_learned(words, "words", [[2, 2, 2]], source="me")  # this process's own: added when learned
        assert feed.poll() == 1 and index.documents == 1
        late.commit()
        assert feed.poll() == 1 and index.documents == 2  # the late row, looked back for
        assert feed.poll() == 0 and index.documents == 2  # each once
        assert index.draft([2, 3], 4).tokens.tolist() == [4]  # type: ignore[union-attr]
        assert index.draft([5, 6], 4).tokens.tolist() == [7, 8]  # type: ignore[union-attr]
        assert index.draft([2, 2], 4) is None
    finally:
        late.close()
        feed.stop()


def test_a_feed_whose_database_is_down_keeps_trying_and_never_raises() -> None:
    index = RecentIndex()
    feed = LearnedFeed("postgresql://u@127.0.0.1:1/db", lambda: [("words", index)], interval=0.01,
                       connect_timeout=1)  # fmt: skip
    feed.start()
    try:
        wait_until(lambda: feed.counts["failed"] >= 2, "the feed stopped trying")
    finally:
        feed.stop()
    assert index.documents == 0 and feed.counts["polls"] == 0


def test_a_preempted_request_is_learned_once_with_its_whole_output(
    words: str, word_tokenizer_dir: Path, novel: tuple[list[int], list[int]]
) -> None:
    prompt, output = novel
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=_settings(words), idle_learn=0)
    runner = Runner(proposer)
    runner.add("p", prompt, output)
    runner.add("q", prompt[:2], output[:6])
    runner.step()
    runner.step()
    held = runner.tokens.pop("p")  # vLLM preempts p: it leaves the batch, its KV cache freed
    for _ in range(3):
        runner.step()  # q runs alone and finishes; the proposer no longer sees p
    runner.tokens["p"] = held  # p resumes with the tokens it had
    runner.run()
    proposer.close()
    rows = [tokens for tokens, _ in _learned(words)]
    assert sorted(rows) == sorted([prompt + output, prompt[:2] + output[:6]])  # p once, whole (short prompts whole)


def test_a_tensor_parallel_rank_other_than_0_learns_nothing(
    words: str, word_tokenizer_dir: Path, novel: tuple[list[int], list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("crest.integrations.vllm.tensor_parallel_rank", lambda: 1)
    prompt, output = novel
    proposer = CrestProposer(vllm_config(word_tokenizer_dir), settings=_settings(words, refresh_interval=0.05))
    try:
        assert proposer.learner is None and proposer.refresher is None
        served = _serve(proposer, prompt, output, "a")
        assert served.drafted > 0  # it drafts as rank 0 does
    finally:
        proposer.close()
    assert _learned(words) == []


def test_the_hub_teaches_the_recent_tier_at_once_and_the_log_in_the_background(words: str) -> None:
    hub = DraftHub(dsn=words, learning=LearnOptions(refresh_interval=0, feed_interval=0), source="serve@test")
    try:
        hub.store("words")
        recent = hub.recent("words")
        assert recent is not None and hub.feed is None  # feed_interval 0: no polling
        hub.learn("words", [2, 3, 4, 5, 6, 7], [8, 2, 3], stats={"steps": 2})
        assert recent.documents == 1 and recent.draft([5, 6, 7], 8).tokens.tolist() == [8, 2, 3]  # type: ignore[union-attr]
        learner = hub.learner("words")
        assert learner is not None and learner.flush(timeout=30)
        assert _learned(words) == [
            ([2, 3, 4, 5, 6, 7, 8, 2, 3], "serve@test")
        ]  # the prompt (< PROMPT_TAIL), the output
    finally:
        hub.close()


def test_a_repeat_behind_a_shared_chat_header_is_found_deep_at_its_answers_first_step(words: str) -> None:
    header = [9, 9, 2]  # the template's assistant header: the same last tokens in every chat request
    rng = np.random.default_rng(5)
    asked = [[int(t) for t in rng.integers(2, 9, size=30)] + header for _ in range(3)]
    answers = [[int(t) for t in rng.integers(2, 9, size=24)] for _ in range(3)]
    hub = DraftHub(dsn=words, learning=LearnOptions(record=False, refresh_interval=0, feed_interval=0))
    try:
        hub.store("words")
        recent = hub.recent("words")
        assert recent is not None
        for prompt, answer in zip(asked, answers, strict=True):
            hub.learn("words", prompt, answer)
        tree = recent.draft(asked[1], 32)  # the second request again: nothing of its answer generated yet
        # its prompt, not only the header, was kept: the match is deep and drafts its own answer, not another's
        assert tree is not None and tree.n >= 16 and tree.tokens.tolist()[:8] == answers[1][:8], tree
    finally:
        hub.close()


def test_a_kind_registered_from_outside_crest_is_served_through_the_hub(
    db_dsn: str, tiny_served: Any, smollm2_tokenizer: Any, smollm2_gguf: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A new drafter kind is one module and one `register` call: here, a drafter of the recent tier alone."""
    from crest.drafters import registry
    from crest.drafters.recent import RecentDrafter
    from crest.serving.app import create_app
    from crest.serving.engine import Engine
    from crest.serving.scheduler import Scheduler
    from tests.fix_serving import Running, flat_cost, greedy_reference

    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    registry.register(registry.Kind("recent_only", ("store",), lambda parts: RecentDrafter(parts["store"].recent)))
    corpus = tmp_path / "toy.jsonl"
    corpus.write_text(json.dumps({"text": "an unrelated text, " * 30}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="toy", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=100))
    sched = Scheduler(tiny_served, smollm2_tokenizer.hf, cost=flat_cost(), max_batch=4)
    learning = LearnOptions(refresh_interval=0, feed_interval=0)
    engine = Engine(sched, smollm2_tokenizer.hf, model_name="tiny", store="toy", drafter="recent_only", dsn=db_dsn,
                    fingerprint=smollm2_tokenizer.fingerprint, learning=learning)  # fmt: skip
    running = Running(create_app(engine), engine, tiny_served, smollm2_tokenizer.hf)
    try:
        prompt = "def add(a, b):\n    return"
        ids = smollm2_tokenizer.hf.encode(prompt, add_special_tokens=False)
        want = smollm2_tokenizer.hf.decode(greedy_reference(tiny_served, ids, 24), skip_special_tokens=True)
        accepted = []
        for _ in range(2):
            reply = running.client().completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
            assert reply.choices[0].text == want
            usage = (reply.usage.model_extra or {}).get("crest", {}) if reply.usage else {}
            accepted.append(int(usage.get("accepted_draft_tokens", 0)))
    finally:
        running.stop()
    assert accepted[0] == 0 and accepted[1] >= 20, accepted  # the first answer drafts the second whole


class _Phrasebook:
    """A toy kind of part from outside crest: per store, one known text; a row's view drafts what follows its context
    there, from the batch's prefetch."""

    opened: list[str] = []
    batches: list[int] = []
    text: list[int] = []

    def __init__(self, store: str) -> None:
        self.store = store

    def follow(self, context: Sequence[int]) -> list[int]:
        text, tail = self.text, list(context[-4:])
        for at in range(len(text) - len(tail), -1, -1):
            if text[at : at + len(tail)] == tail:
                return text[at + len(tail) : at + len(tail) + 8]
        return []


class _PhraseLease:
    def __init__(self, book: _Phrasebook) -> None:
        self.book, self.misses = book, 0
        self.ready: tuple[int, list[int]] | None = None  # (context length, prefetched continuation)

    def draft(self, context: Sequence[int], max_nodes: int) -> Draft | None:
        ready, self.ready = self.ready, None
        if ready is None or ready[0] != len(context):
            self.misses += 1
            ready = (len(context), self.book.follow(context))
        ids = ready[1][:max_nodes]
        if not ids:
            return None
        k = len(ids)
        return Draft(np.array(ids, np.int64), np.arange(-1, k - 1, dtype=np.int32), np.full(k, 4, np.int64), 4)


def _prefetch_phrases(leases: Sequence[_PhraseLease], rows: Sequence[Any], max_nodes: int) -> None:
    _Phrasebook.batches.append(len(leases))
    for lease, row in zip(leases, rows, strict=True):
        lease.ready = (len(row.context), lease.book.follow(row.context))


def _open_phrasebook(store: str, **_: Any) -> _Phrasebook:
    _Phrasebook.opened.append(store)
    return _Phrasebook(store)


def test_a_kind_on_a_new_kind_of_part_from_outside_crest_is_opened_once_leased_and_prefetched_per_batch(
    db_dsn: str, tiny_served: Any, smollm2_tokenizer: Any, smollm2_gguf: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A new kind of part is one module: its `Part` (open, lease, prefetch) and the `Kind` built on it, registered."""
    from crest.drafters import parts, registry
    from crest.serving.app import create_app
    from crest.serving.engine import Engine
    from crest.serving.scheduler import Scheduler
    from tests.fix_serving import Running, flat_cost, greedy_reference

    monkeypatch.setattr(registry, "_KINDS", dict(registry._KINDS))
    monkeypatch.setattr(parts, "_PARTS", dict(parts._PARTS))
    parts.register_part(parts.Part("phrasebook", "--store NAME", _open_phrasebook, lease=_PhraseLease,
                                   prefetch=_prefetch_phrases))  # fmt: skip
    registry.register(registry.Kind("phrases", ("phrasebook",), lambda found: found["phrasebook"]))
    corpus = tmp_path / "toy.jsonl"
    corpus.write_text(json.dumps({"text": "an unrelated text, " * 30}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="toy", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=IngestOptions(top_t=100))
    prompts = ["def add(a, b):\n    return", "class Point:\n    def", "import os\nimport"]
    wants = []
    for prompt in prompts:
        ids = smollm2_tokenizer.hf.encode(prompt, add_special_tokens=False)
        out = greedy_reference(tiny_served, ids, 24)
        wants.append(smollm2_tokenizer.hf.decode(out, skip_special_tokens=True))
        _Phrasebook.text = [*_Phrasebook.text, *ids, *out]
    _Phrasebook.opened, _Phrasebook.batches = [], []
    sched = Scheduler(tiny_served, smollm2_tokenizer.hf, cost=flat_cost(), max_batch=4)
    engine = Engine(sched, smollm2_tokenizer.hf, model_name="tiny", store="toy", drafter="phrases", dsn=db_dsn,
                    fingerprint=smollm2_tokenizer.fingerprint, learning=LearnOptions(refresh_interval=0, recent=None,
                    feed_interval=0))  # fmt: skip
    running = Running(create_app(engine), engine, tiny_served, smollm2_tokenizer.hf)
    try:
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: running.client().completions.create(model="tiny", prompt=p,
                                    max_tokens=24, temperature=0), prompts))  # fmt: skip
    finally:
        running.stop()
    assert [r.choices[0].text for r in replies] == wants  # exact, whatever the part drafts
    accepted = [int(((r.usage.model_extra or {}) if r.usage else {}).get("crest", {}).get("accepted_draft_tokens", 0))
                for r in replies]  # fmt: skip
    assert min(accepted) >= 12, accepted  # the part drafted every answer from the known text
    assert _Phrasebook.opened == ["toy"]  # opened once for all requests
    assert max(_Phrasebook.batches) > 1  # rows of one step looked up in one prefetch
