"""The vLLM proposer's hot path (crest.integrations.rows, crest.integrations.chain's `ChainStream`): a row follows
its last deep chain without a lookup, a deep recent-tier match drafts without the database, the rest look up unless
the `LookupGate` finds their lookups do not pay for their CPU time."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from crest_client.draft import Draft, path_probabilities

from crest.config import IngestOptions
from crest.decoding.policy import DraftPolicy
from crest.drafters.prompt import PromptDrafter
from crest.drafters.recent import RecentIndex, RecentOptions
from crest.drafting.hub import DraftHub, LearnOptions
from crest.ingest.pipeline import ingest
from crest.integrations.chain import ChainStream, discount_tail
from crest.integrations.rows import DEEP_MATCH, MAX_REST, VALUE_DECAY, LookupGate, ProposerRow, draft_chains

pytest_plugins = ["tests.fix_corpus"]


def _chain(tokens: list[int], weights: list[int]) -> Draft:
    k = len(tokens)
    return Draft(np.array(tokens, np.int64), np.arange(-1, k - 1, dtype=np.int32), np.array(weights, np.int64), 3, 10)


def test_a_stream_goes_on_only_while_the_target_follows_it() -> None:
    stream = ChainStream()
    stream.start(_chain([5, 6, 7, 8, 9, 10], [8, 8, 6, 6, 3, 3]), {"recent": 6, "prompt": 2}, at=100)
    assert stream.take(2, at=100) is not None and stream.take(7, at=100) is None  # it holds 6 tokens
    stream.advance(100, [5, 6])  # one chain token accepted, then the bonus token: the stream's next two
    nxt = stream.take(3, at=102)
    assert nxt is not None and nxt.tokens.tolist() == [7, 8, 9]
    # the path probabilities are conditioned on the consumed prefix (6 of the 8 that went through token 6)
    assert path_probabilities(nxt).tolist() == pytest.approx([6 / 8, 6 / 8, 3 / 8])
    assert stream.parts == {"recent": 4}  # the prompt's tree held only the consumed tokens
    assert stream.take(3, at=103) is None  # another context than the one it follows
    stream.advance(102, [7, 99])  # the target left the path
    assert stream.take(1, at=104) is None and stream.parts == {}


@pytest.mark.parametrize("seed", range(4), ids=lambda s: f"seed{s}")
def test_a_streams_kept_probabilities_are_those_computed_afresh(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(40):
        k = int(rng.integers(2, 24))
        falling = np.sort(rng.integers(1, 50, size=k))[::-1].tolist()
        rising = rng.integers(1, 50, size=k).tolist()  # a chain whose weights rise: `chain_scale` refuses it
        weights = falling if rng.random() < 0.7 else rising
        tokens = rng.integers(0, 1000, size=k).tolist()
        stream = ChainStream()
        stream.start(_chain(tokens, weights), {}, at=50)
        used = int(rng.integers(1, k))
        stream.advance(50, tokens[:used])
        kept = stream.chain
        fresh = Draft(kept.tokens, kept.parents, kept.weights, kept.n, kept.total)  # nothing kept on it
        assert path_probabilities(kept).tolist() == path_probabilities(fresh).tolist()


def test_a_stream_from_one_earlier_text_reads_on_in_it_while_the_target_follows() -> None:
    index = RecentIndex()
    text = list(range(100, 160))
    index.add(text)
    index.add(list(range(200, 260)))  # the next document: never read into
    tree, at = index.follow(text[:20], 8)  # a chain: text[20:28], then text goes on at position 28
    assert tree is not None and tree.tokens.tolist() == text[20:28] and at == 28
    stream = ChainStream()
    stream.start(tree, {"recent": 8}, at=20, source=index, source_at=at)
    stream.advance(20, text[20:27])  # 6 accepted and the bonus: one token left, fewer than the step wants
    nxt = stream.take(4, at=27)
    assert nxt is not None and nxt.tokens.tolist() == text[27:31]  # read on, as deep as it started: 8 tokens held
    assert stream.chain.tokens.tolist() == text[27:35] and stream.parts == {"recent": 8}
    assert path_probabilities(nxt).tolist() == [1.0] * 4  # as sure as the chain's last node
    for at in (27, 32, 37, 42, 47, 52):  # 4 accepted and the bonus each step, reading on whenever 4 + 1 are not held
        assert stream.take(4, at=at).tokens.tolist() == text[at : at + 4]  # type: ignore[union-attr]
        stream.advance(at, text[at : at + 5])
    assert stream.take(4, at=57) is None  # the text ends at 60: nothing of the next document
    assert stream.take(3, at=57).tokens.tolist() == text[57:60]  # type: ignore[union-attr]
    plain = ChainStream()  # without a source (a lookup's merged chain): no reading on
    plain.start(tree, {"recent": 8}, at=20)
    plain.advance(20, text[20:27])
    assert plain.take(4, at=27) is None


@pytest.fixture
def hub(db_dsn: str, word_tokenizer_dir: Path, tmp_path: Path) -> Iterator[DraftHub]:
    corpus = tmp_path / "words.jsonl"
    corpus.write_text(json.dumps({"text": "the cat sat on the mat " * 40}) + "\n", encoding="utf-8")
    ingest([str(corpus)], store="words", tokenizer=str(word_tokenizer_dir), dsn=db_dsn, options=IngestOptions(top_t=50))
    learning = LearnOptions(record=False, refresh_interval=0.0, recent=RecentOptions(capacity=4096), feed_interval=0)
    found = DraftHub(dsn=db_dsn, read_dsn=db_dsn, learning=learning)
    yield found
    found.close()


def test_rows_on_a_text_served_before_draft_it_from_memory_without_the_database(hub: DraftHub) -> None:
    rng = np.random.default_rng(7)
    served = [int(t) for t in rng.integers(2, 10, size=400)]  # a text the store never saw, served once before
    store = hub.store("words")
    index = hub.recent("words")
    assert index is not None
    index.add(np.array(served))
    calls = {"n": 0}
    lookup = index.follow

    def counted(*args: Any, **kwargs: Any) -> tuple[Draft | None, int]:
        calls["n"] += 1
        return lookup(*args, **kwargs)

    index.follow = counted  # type: ignore[method-assign]
    policy = DraftPolicy(budget=32, adaptive=False)
    rows = []
    for start in (0, 150):
        parts = hub.row_parts("crest+prompt", "words")
        rows.append(ProposerRow(parts.drafter, parts.leases, 0, served[start : start + DEEP_MATCH]))
    k, steps, before = 8, 0, store.stats["lookups"]
    while all(len(r.tokens) < DEEP_MATCH + 200 for r in rows):
        chains = draft_chains(policy, [(r, k) for r in rows])
        for row, chain, start in zip(rows, chains, (0, 150), strict=True):
            at = len(row.tokens)
            truth = served[start + at : start + at + k + 1]
            assert chain.tokens.tolist() == truth[:k]  # the served text's continuation, whole, every step
            row.chain = chain
            row.verified(truth)
            row.stream.advance(at, truth)
            row.tokens.extend(truth)
        steps += 1
    assert store.stats["lookups"] == before  # no row ever needed the database
    # each row found the text once; its stream then read on in it, with no lookup at all, for 23 steps
    assert calls["n"] == len(rows) and steps == 23
    assert all(r.parts == {"recent": r.accepted} and r.accepted == k * steps for r in rows)


def test_a_row_off_every_stream_looks_up_its_store_once_per_step(hub: DraftHub) -> None:
    text = [int(t) for t in np.random.default_rng(3).integers(2, 10, size=64)]  # nothing served: no recent match
    parts = hub.row_parts("crest+prompt", "words")
    row = ProposerRow(parts.drafter, parts.leases, 0, text[:20])
    store = hub.store("words")
    policy = DraftPolicy(budget=32, adaptive=False)
    for step in range(5):
        before = store.stats["lookups"]
        (chain,) = draft_chains(policy, [(row, 4)])
        assert store.stats["lookups"] == before + 1, step
        at = len(row.tokens)
        first = chain.tokens.tolist()[:1]
        nxt = [next(t for t in (text[at], 2, 3) if [t] != first)]  # the target takes none of the chain
        row.chain = chain
        row.verified(nxt)
        row.stream.advance(at, nxt)
        row.tokens.extend(nxt)


@pytest.mark.parametrize("k", [8, 16], ids=["room-below-the-continuation", "room-above-it"])
def test_a_row_copying_its_own_text_reads_on_in_it_after_one_lookup(k: int) -> None:
    """A chain the prompt part copied after a match of its deepest length reads on in the row's own text while
    the target follows it: one lookup for the whole copy, as `suffix` drafts a copied prompt, also when a step
    verifies more than the prompt part's 10-token continuation."""
    rng = np.random.default_rng(5)
    text = [int(t) for t in rng.integers(2, 200, size=120)]  # a passage the answer copies, and nothing repeats
    prompt = [*text, 1, *text[:8]]  # the answer has begun the copy: an 8-token match
    drafter = PromptDrafter(max_ngram=8, continuation_length=10)
    calls = {"n": 0}
    draft = drafter.draft

    def counted(*args: Any, **kwargs: Any) -> Draft | None:
        calls["n"] += 1
        return draft(*args, **kwargs)

    drafter.draft = counted  # type: ignore[method-assign]
    row = ProposerRow(drafter, {}, len(prompt), list(prompt))
    policy = DraftPolicy(budget=32, adaptive=False)
    steps = 0
    while len(row.tokens) + k + 1 <= len(prompt) + 100:
        at = len(row.tokens)
        (chain,) = draft_chains(policy, [(row, k)])
        truth = text[at - len(text) - 1 : at - len(text) - 1 + k + 1]  # the copy goes on
        assert chain.tokens.tolist() == truth[:k], steps
        row.chain = chain
        row.verified(truth)
        row.stream.advance(at, truth)
        row.tokens.extend(truth)
        steps += 1
    assert calls["n"] == 1 and steps == 99 // (k + 1)  # read on for the copy after one lookup of 10 tokens
    assert row.parts == {"prompt": k * steps}


def test_a_chains_tail_past_its_match_is_weighed_down_and_kept_only_where_it_is_nearly_free() -> None:
    from crest.decoding.policy import batch_draft_sizes
    from crest.decoding.sizing import CostModel

    chain = _chain(list(range(10)), [8] * 10)  # one continuation seen 8 times: as sure at its tenth node as its first
    tail = discount_tail(chain, sure=4, factor=0.5)
    assert path_probabilities(tail).tolist() == pytest.approx([0.8] * 4 + [0.4, 0.2, 0.1, 0.05, 0.025, 0.0125])
    assert tail.tokens.tolist() == chain.tokens.tolist() and discount_tail(chain, sure=10, factor=0.5) is chain
    cpu = CostModel([1, 2, 4, 8, 16], [1.0, 1.1, 1.3, 1.7, 2.5])  # each verified token costs a tenth of a step
    flat = CostModel([1, 16], [1.0, 1.0])
    assert batch_draft_sizes([chain], cpu) == [10]
    assert batch_draft_sizes([tail], cpu) == [5]  # the first tail node (0.4) still pays for a tenth of a step
    assert batch_draft_sizes([tail], flat) == [10]  # nearly free: the whole tail is still verified


def _gate(bar: float) -> LookupGate:
    gate = LookupGate()
    gate.cost, gate.rate = 1e-3, bar * 1e3  # a lookup costs 1 ms of CPU; the engine makes bar tokens in that time
    return gate


def _pattern(gate: LookupGate, row: ProposerRow, steps: int, *, got: int = 0) -> str:
    """Return L (looked up, its chain got `got` tokens accepted) or R (rested) for each step."""
    seen = ""
    for _ in range(steps):
        if gate.rests(row):
            seen += "R"
        else:
            seen += "L"
            row.learn_value(got)
    return seen


def test_a_row_whose_lookups_do_not_pay_rests_twice_as_long_each_time_up_to_max_rest() -> None:
    gate, row = _gate(0.5), ProposerRow(None, {}, 0, [1, 2, 3])
    seen = _pattern(gate, row, 60)
    fails = next(i for i in range(1, 20) if VALUE_DECAY**i < 0.5)  # the optimistic first value decays to the bar
    want = "L" * fails + "".join("R" * rest + "L" for rest in (1, 2, 4, MAX_REST, MAX_REST))
    assert seen.startswith(want), seen
    assert gate.rested == seen.count("R")


def test_a_row_whose_lookups_pay_never_rests_and_one_that_pays_again_stops_resting() -> None:
    gate = _gate(0.5)
    paying = ProposerRow(None, {}, 0, [1])
    assert _pattern(gate, paying, 30, got=2) == "L" * 30
    failing = ProposerRow(None, {}, 0, [1])
    assert "RR" in _pattern(gate, failing, 40)  # resting
    seen = _pattern(gate, failing, 40, got=4)  # its text turned to something the store knows
    assert seen.endswith("L" * 20) and failing.backoff == 0


def test_rows_go_on_looking_up_through_misses_where_a_forward_dwarfs_a_lookup() -> None:
    gate, row = _gate(1e-4), ProposerRow(None, {}, 0, [1])  # a CPU's: a forward of 65 ms, 0.4 ms of lookup
    assert _pattern(gate, row, 60) == "L" * 60  # 60 misses in a row (where a bar of 0.5 rests it after 7)


def test_the_stream_of_a_lookups_chain_is_credited_to_that_lookup() -> None:
    row = ProposerRow(None, {}, 0, [1, 2])
    row.looked, row.chain = True, _chain([5, 6], [4, 4])
    row.verified([5, 6, 7])  # the lookup's chain, accepted whole
    after_lookup = row.value
    assert after_lookup == pytest.approx(VALUE_DECAY * 1.0 + (1 - VALUE_DECAY) * 2)
    row.looked, row.streamed, row.chain = False, True, _chain([8, 9, 10], [4, 4, 4])
    row.verified([8, 9, 10, 11])  # the stream's next chain: that lookup's tokens too
    assert row.value == pytest.approx(after_lookup + (1 - VALUE_DECAY) * 3)
    row.streamed, row.chain = False, _chain([12], [4])
    row.verified([12, 13])  # a deep recent match's chain: no lookup to credit
    assert row.value == pytest.approx(after_lookup + (1 - VALUE_DECAY) * 3)
    row.looked = True
    row.hand(_chain([], []))  # a lookup that drafted nothing (or was cut to nothing) brought 0
    assert row.value == pytest.approx(VALUE_DECAY * (after_lookup + (1 - VALUE_DECAY) * 3)) and row.fresh


def test_a_row_whose_lookups_miss_asks_the_store_less_often_behind_a_gate(hub: DraftHub) -> None:
    text = [int(t) for t in np.random.default_rng(3).integers(2, 10, size=200)]  # nothing served: no recent match
    store = hub.store("words")
    policy = DraftPolicy(budget=32, adaptive=False)
    counts = []
    for gate in (None, _gate(5.0)):  # no gate; a bar no lookup here reaches (a fast accelerator at a large batch)
        parts = hub.row_parts("crest+prompt", "words")
        row = ProposerRow(parts.drafter, parts.leases, 0, text[:20])
        before = store.stats["lookups"]
        for _ in range(40):
            (chain,) = draft_chains(policy, [(row, 4)], gate=gate)
            row.hand(chain)
            at = len(row.tokens)
            first = chain.tokens.tolist()[:1]
            nxt = [next(t for t in (text[at], 2, 3) if [t] != first)]  # the target takes none of the chain
            if len(chain):
                row.verified(nxt)
            row.stream.advance(at, nxt)
            row.tokens.extend(nxt)
        counts.append(store.stats["lookups"] - before)
    assert counts[0] == 40 and counts[1] <= 12, counts  # resting 1, 2, 4, 8, 8... steps between lookups


def test_a_cold_first_lookup_does_not_set_the_bar() -> None:
    gate = LookupGate()
    gate.looked(0.05, 1)  # a new connection, cold caches: 50 ms for one row
    for _ in range(4):
        gate.looked(0.002, 4)  # then 0.5 ms a row
    assert gate.cost == pytest.approx(0.0005)
