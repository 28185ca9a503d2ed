"""The learned feed on a real PostgreSQL (crest.learning.feed): a row one hub learned reaches another process's recent
tier with the prompt tail the teaching process kept (`PROMPT_TAIL`), by the poll and by the warm-up at start, so a
repeat of a long prompt whose last max-n tokens (a chat template's assistant header) every prompt shares drafts its
own earlier answer deep at its first step on another replica and after a restart, as on the replica that served it.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import numpy as np
import psycopg
import pytest
from crest_client.learner import LEARNED_CHANNEL, Learner

from crest.config import IngestOptions
from crest.drafters.recent import RecentIndex
from crest.drafting.hub import DraftHub, LearnOptions
from crest.ingest.pipeline import ingest
from crest.learning.feed import LearnedFeed
from crest.learning.requests import PROMPT_TAIL, path_length
from tests.fix_wait import wait_until

pytest_plugins = ["tests.fix_corpus"]

HEADER = [2, 3, 4, 5]  # the template's assistant header: the last max-n (4) tokens of every prompt
DEEP = 16  # answer tokens a deep match drafts at its first step (a max-n deep one: at most max-n + 2)


@pytest.fixture
def words(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> str:
    """A store `words` (the word tokenizer, max-n 4); its DSN."""
    corpus = tmp_path / "words.jsonl"
    corpus.write_text(json.dumps({"text": " ".join(["the cat sat on the mat a dog sat on a mat"] * 20)}) + "\n")
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn,
           options=IngestOptions(top_t=500))  # fmt: skip
    return db_dsn


def _chats(seed: int) -> tuple[list[list[int]], list[list[int]]]:
    """Return three prompts longer than PROMPT_TAIL, each ending in HEADER, and their answers."""
    rng = np.random.default_rng(seed)
    asked = [[int(t) for t in rng.integers(10, 1000, size=PROMPT_TAIL + 36)] + HEADER for _ in range(3)]
    answers = [[int(t) for t in rng.integers(10, 1000, size=24)] for _ in range(3)]
    return asked, answers


def _hub(dsn: str, source: str, *, record: bool, feed_interval: float = 0.05) -> DraftHub:
    learning = LearnOptions(record=record, refresh_interval=0, feed_interval=feed_interval, flush_interval=0.05)
    hub = DraftHub(dsn=dsn, learning=learning, source=source)
    hub.start()
    return hub


def _polls_after_open(hub: DraftHub) -> None:
    """Open the store and wait for a whole poll begun after it (its warm-up), so later rows come by polling."""
    assert hub.feed is not None
    polls = hub.feed.counts["polls"]
    hub.store("words")
    wait_until(lambda: hub.feed is not None and hub.feed.counts["polls"] >= polls + 2, "the feed never polled")


def _assert_drafts_deep(index: RecentIndex, asked: list[list[int]], answers: list[list[int]]) -> None:
    for prompt, answer in zip(asked, answers, strict=True):  # each repeat at its answer's first step
        tree = index.draft(prompt, 32)
        assert tree is not None and path_length(tree, answer) >= DEEP, (tree, answer[:DEEP])


def test_a_learned_row_reaches_another_replica_and_a_restart_with_its_prompt_tail(words: str) -> None:
    asked, answers = _chats(3)
    teacher, other = _hub(words, "serve@a", record=True), _hub(words, "serve@b", record=False)
    try:
        teacher.store("words")
        _polls_after_open(other)
        polled = other.recent("words")
        assert polled is not None and polled.documents == 0
        for prompt, answer in zip(asked, answers, strict=True):
            teacher.learn("words", prompt, answer)
        learner = teacher.learner("words")
        assert learner is not None and learner.flush(timeout=30)
        wait_until(lambda: polled.documents == 3, "the other replica's feed never brought the learned rows")
        _assert_drafts_deep(polled, asked, answers)
    finally:
        teacher.close()
        other.close()
    with psycopg.connect(words) as conn:
        rows = conn.execute("SELECT tokens, prompt_tokens FROM crest_learned ORDER BY id").fetchall()
    want = [(p[-PROMPT_TAIL:] + a, PROMPT_TAIL) for p, a in zip(asked, answers, strict=True)]
    assert [(np.frombuffer(t, "<u4").tolist(), k) for t, k in rows] == want  # the tail the recent tier keeps
    restarted = _hub(words, "serve@c", record=False)  # a new process: the rows are in the log before it starts
    try:
        restarted.store("words")
        warmed = restarted.recent("words")
        assert warmed is not None
        wait_until(lambda: warmed.documents == 3, "the restarted process was never warmed from the log")
        _assert_drafts_deep(warmed, asked, answers)
    finally:
        restarted.close()


def test_a_learned_batch_is_notified_when_it_commits_without_a_flush(words: str) -> None:
    with psycopg.connect(words, autocommit=True) as listen, Learner(words, "words", flush_interval=0.05) as learner:
        listen.execute(f"LISTEN {LEARNED_CHANNEL}")
        learner.learn([7, 8, 9])  # no flush: the writer writes once the row has waited its interval
        payloads = [note.payload for note in listen.notifies(timeout=30, stop_after=1)]
    assert payloads == ["words"]


def test_a_replica_feeds_a_notified_row_long_before_its_poll_interval(words: str) -> None:
    asked, answers = _chats(5)
    teacher = _hub(words, "serve@a", record=True)
    other = _hub(words, "serve@b", record=False, feed_interval=3600.0)  # polls once an hour: notifications only
    try:
        teacher.store("words")
        assert other.feed is not None
        other.store("words")  # the feed wakes to warm it, then waits an hour or for a notification
        polled = other.recent("words")
        assert polled is not None
        teacher.learn("words", asked[0], answers[0])  # by the warm-up or a notification: either way, in
        wait_until(lambda: polled.documents == 1, "the first row never reached the other replica", timeout=30)
        notified = other.feed.counts["notified"]
        for prompt, answer in zip(asked[1:], answers[1:], strict=True):  # now only a notification brings them
            teacher.learn("words", prompt, answer)
        wait_until(lambda: polled.documents == 3, "a notified batch never reached the other replica", timeout=30)
        assert other.feed.counts["notified"] > notified
        _assert_drafts_deep(polled, asked, answers)
    finally:
        teacher.close()
        other.close()


def test_a_feed_that_cannot_listen_polls_on_its_interval(words: str) -> None:
    index = RecentIndex()
    with socket.socket() as free:  # a port nothing listens on: the listening connection is refused
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    feed = LearnedFeed(words, lambda: [("words", index)], interval=0.05, listen=True,
                       listen_dsn=f"postgresql://crest@127.0.0.1:{port}/crest", connect_timeout=1)  # fmt: skip
    feed.start()
    try:
        with Learner(words, "words", flush_interval=0.05) as learner:
            learner.learn([7, 8, 9, 10])
            assert learner.flush(timeout=30)
        wait_until(lambda: index.documents == 1, "a feed that cannot listen stopped polling", timeout=30)
        assert feed.counts["notified"] == 0
    finally:
        feed.stop()
