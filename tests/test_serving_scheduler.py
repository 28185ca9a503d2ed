"""Continuous batching is exact: every row of a batched step decodes as that prompt alone (`model.generate`).

Tiny random llama models in float64 (and float32), hypothesis over batch compositions: number of rows, batch
limit (so requests wait), prompt lengths (1 token included), join steps, lengths, and drafters (none, prompt
lookup on repetitive prompts, an oracle tree holding the true path at a random depth among wrong siblings,
random trees). On a mismatch the message shows the target's top-2 logit gap at the first differing token: a
rounding flip shows a gap near 1e-6 (float32) or 1e-15 (float64); a bug does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import pytest
import torch
from crest_client.draft import Draft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crest.decoding.generator import SpeculativeGenerator
from crest.decoding.sizing import CostModel
from crest.drafters import PromptDrafter
from crest.errors import ConfigError, ModelError
from crest.serving.batch import BatchCache, check_batchable
from crest.serving.scheduler import QueueFull, Request, Scheduler
from tests.fix_models import IdTokenizer, tiny_model
from tests.fix_serving import drive

pytestmark = pytest.mark.usefixtures("torch_threads")

VOCAB = 64
FLAT = CostModel([1, 64], [1.0, 1.0])  # drafting always pays: whole trees are verified
STEEP = CostModel([1, 2, 64], [1.0, 2.0, 64.0])  # every token costs as much as a step: drafting never pays


@cache
def model(dtype: torch.dtype = torch.float64) -> Any:
    return tiny_model("llama", vocab=VOCAB, dtype=dtype)


@cache
def reference(prompt: tuple[int, ...], max_tokens: int, dtype: torch.dtype = torch.float64) -> list[int]:
    """Return `model.generate`'s greedy output for the prompt alone."""
    ids = torch.tensor([prompt])
    out = model(dtype).generate(
        ids,
        attention_mask=torch.ones_like(ids),  # token 0 is also the pad id: never inferred as padding
        max_new_tokens=max_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=VOCAB - 1,
    )
    return [int(t) for t in out[0, len(prompt) :]]


@torch.no_grad()
def top2_gap(prompt: Sequence[int], out: Sequence[int], at: int, dtype: torch.dtype) -> float:
    """Return the target's top-2 logit gap at output position `at` (plain forward of the prompt and out[:at])."""
    ids = torch.tensor([list(prompt) + list(out[:at])])
    logits = model(dtype)(ids).logits[0, -1]
    top = torch.topk(logits, 2).values
    return float(top[0] - top[1])


def check_exact(prompt: Sequence[int], got: Sequence[int], max_tokens: int, dtype: torch.dtype) -> None:
    want = reference(tuple(prompt), max_tokens, dtype)
    if got != want:
        at = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), min(len(got), len(want)))
        gap = top2_gap(prompt, want, at, dtype)
        pytest.fail(f"row differs at token {at}: got {got}, want {want}; top-2 logit gap there {gap:.3g}")


class OracleDrafter:
    """Drafts the true continuation (from `model.generate`) to a random depth, with random wrong siblings."""

    def __init__(self, prompt: Sequence[int], max_tokens: int, seed: int, dtype: torch.dtype) -> None:
        self.truth = list(prompt) + reference(tuple(prompt), max_tokens, dtype)
        self.rng = np.random.default_rng(seed)

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        ahead = self.truth[len(context_ids) : len(context_ids) + int(self.rng.integers(0, 6))]
        tokens, parents = [], []
        for depth, token in enumerate(ahead):
            parent = -1 if depth == 0 else 2 * (depth - 1)
            tokens += [token, (token + 1 + int(self.rng.integers(0, VOCAB - 2))) % VOCAB]
            parents += [parent, parent]
        if not tokens:
            return None
        n = len(tokens)
        return Draft(np.array(tokens), np.array(parents, dtype=np.int32), np.arange(n, 0, -1) * 10)


class RandomDrafter:
    """Drafts random trees over the vocabulary (rarely right): stresses padding and rejection."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        n = int(self.rng.integers(0, 12))
        parents = [int(self.rng.integers(-1, i)) for i in range(n)]
        return Draft(self.rng.integers(0, VOCAB, n), np.array(parents, dtype=np.int32), np.arange(n, 0, -1))


def make_drafter(kind: str, prompt: Sequence[int], max_tokens: int, seed: int, dtype: torch.dtype) -> Any:
    if kind == "prompt":
        return PromptDrafter()
    if kind == "oracle":
        return OracleDrafter(prompt, max_tokens, seed, dtype)
    if kind == "random":
        return RandomDrafter(seed)
    return None


prompts = st.one_of(
    st.lists(st.integers(0, VOCAB - 2), min_size=1, max_size=20),
    st.lists(st.integers(0, VOCAB - 2), min_size=2, max_size=5).map(lambda p: p * 4),  # repetitive
)
rows = st.tuples(
    prompts, st.integers(0, 6), st.integers(1, 16), st.sampled_from(["none", "prompt", "oracle", "random"])
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.lists(rows, min_size=1, max_size=5), max_batch=st.integers(1, 4), seed=st.integers(0, 9))
def test_batched_greedy_equals_generate(
    batch: list[tuple[list[int], int, int, str]], max_batch: int, seed: int
) -> None:
    dtype = torch.float64
    sched = Scheduler(model(dtype), IdTokenizer(), max_batch=max_batch, cost=FLAT)
    joins = [
        (at, Request(prompt, max_tokens=n, drafter=make_drafter(kind, prompt, n, seed + i, dtype)))
        for i, (prompt, at, n, kind) in enumerate(batch)
    ]
    for (_, request), outcome in zip(joins, drive(sched, joins), strict=True):
        check_exact(request.prompt, outcome.result.output_token_ids, request.max_tokens, dtype)
        assert outcome.accepted_draft_tokens + outcome.rejected_draft_tokens == outcome.result.draft_tokens
    assert sched.batch.rows == 0


def test_batched_greedy_float32_with_long_rows() -> None:
    dtype = torch.float32
    rng = np.random.default_rng(3)
    batch = [rng.integers(0, VOCAB - 1, n).tolist() for n in (1, 7, 30, 3, 60, 12, 9, 2)]
    sched = Scheduler(model(dtype), IdTokenizer(), max_batch=5, cost=FLAT)
    joins = [
        (2 * i, Request(p, max_tokens=40, drafter=OracleDrafter(p, 40, i, dtype) if i % 2 else PromptDrafter()))
        for i, p in enumerate(batch)
    ]
    outcomes = drive(sched, joins)
    for (_, request), outcome in zip(joins, outcomes, strict=True):
        check_exact(request.prompt, outcome.result.output_token_ids, 40, dtype)
    assert sum(o.accepted_draft_tokens for o in outcomes) > 20  # the oracle rows were accepted deep


def test_sampled_rows_keep_their_own_seeded_draws() -> None:
    dtype = torch.float64
    m = model(dtype)
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [11]]
    sched = Scheduler(m, IdTokenizer(), max_batch=3, cost=FLAT)
    joins = [(i, Request(p, max_tokens=12, temperature=0.9, top_p=0.9, seed=40 + i)) for i, p in enumerate(prompts)]
    outcomes = drive(sched, joins)
    gen = SpeculativeGenerator(m, IdTokenizer(), max_draft_tokens=0)
    for i, (p, outcome) in enumerate(zip(prompts, outcomes, strict=True)):
        alone = gen.generate(p, max_new_tokens=12, temperature=0.9, top_p=0.9, seed=40 + i)
        assert outcome.result.output_token_ids == alone.output_token_ids


def test_draft_size_shrinks_to_nothing_when_it_does_not_pay() -> None:
    dtype = torch.float64
    prompt = [4, 5, 6, 7] * 5
    sched = Scheduler(model(dtype), IdTokenizer(), max_batch=2, cost=STEEP)
    sched.policy.observe(accepted=5, predicted=10.0)  # evidence at the prior ratio: no exploration probes
    outcome = drive(sched, [(0, Request(prompt, max_tokens=10, drafter=OracleDrafter(prompt, 10, 0, dtype)))])[0]
    check_exact(prompt, outcome.result.output_token_ids, 10, dtype)
    assert outcome.result.draft_tokens == 0


def test_drafters_are_spared_while_drafting_does_not_pay() -> None:
    dtype = torch.float64
    prompt = [4, 5, 6, 7] * 5

    class Counting(OracleDrafter):
        calls = 0

        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
            Counting.calls += 1
            return super().draft(context_ids, max_nodes)

    sched = Scheduler(model(dtype), IdTokenizer(), max_batch=2, cost=STEEP)
    sched.policy.observe(accepted=5, predicted=10.0)  # evidence at the prior ratio: no exploration probes
    outcome = drive(sched, [(0, Request(prompt, max_tokens=40, drafter=Counting(prompt, 40, 0, dtype)))])[0]
    check_exact(prompt, outcome.result.output_token_ids, 40, dtype)
    assert outcome.result.draft_tokens <= 8  # at most the exploration probes (every 16 idle steps, 4 nodes)
    assert 0 < Counting.calls <= 12 < outcome.result.forward_passes  # backed off up to MAX_BACKOFF steps at a time


def test_cancelled_and_failing_rows_leave_the_others_alone() -> None:
    dtype = torch.float64

    class Broken:
        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
            raise RuntimeError("boom")

    sched = Scheduler(model(dtype), IdTokenizer(), max_batch=3, cost=FLAT)
    keep = Request([1, 2, 3, 1, 2, 3], max_tokens=20, drafter=Broken())
    gone = Request([9, 8, 7], max_tokens=50)
    f_keep, f_gone = sched.submit(keep), sched.submit(gone)
    sched.step()
    gone.cancelled.set()
    while not f_keep.done():
        sched.step()
    assert f_gone.result().cancelled
    check_exact(keep.prompt, f_keep.result().result.output_token_ids, 20, dtype)


@pytest.mark.parametrize(
    ("request_", "error"),
    [
        (Request([], max_tokens=4), ModelError),
        (Request([VOCAB + 3], max_tokens=4), ModelError),
        (Request([1], max_tokens=0), ConfigError),
        (Request([1], max_tokens=4, temperature=-1.0), ConfigError),
    ],
    ids=["empty", "out-of-vocab", "no-tokens", "bad-temperature"],
)
def test_bad_requests_raise_at_submit(request_: Request, error: type[Exception]) -> None:
    sched = Scheduler(model(), IdTokenizer(), cost=FLAT)
    with pytest.raises(error):
        sched.submit(request_)
    assert sched.queued == 0


def test_queue_bound() -> None:
    sched = Scheduler(model(), IdTokenizer(), max_batch=1, max_queue=2, cost=FLAT)
    for _ in range(3):  # one for the free row, two queued
        sched.submit(Request([1, 2], max_tokens=2))
    with pytest.raises(QueueFull):
        sched.submit(Request([1, 2], max_tokens=2))


def test_sliding_window_models_are_refused() -> None:
    with pytest.raises(ModelError, match="sliding window"):
        check_batchable(tiny_model("mistral", vocab=VOCAB, sliding_window=8))
    BatchCache(tiny_model("mistral", vocab=VOCAB))  # no window: batched


class CountingStore:
    """Records `draft_many` calls; drafts the context's last token + 1 (or raises, when `down`)."""

    def __init__(self, *, down: bool = False) -> None:
        self.calls: list[int] = []
        self.down = down

    def draft_many(self, contexts: Sequence[Sequence[int]], max_nodes: int = 64) -> list[Draft | None]:
        self.calls.append(len(contexts))
        if self.down:
            raise OSError("database down")
        return [Draft(np.array([c[-1] + 1]), np.array([-1], dtype=np.int32), np.array([1])) for c in contexts]

    def draft(self, context_ids: Sequence[int], max_nodes: int = 64) -> Draft | None:
        raise AssertionError("a prefetched row must not look up alone")


def test_prefetch_is_one_round_trip_per_store_and_errors_cost_drafts_only() -> None:
    from crest.drafters.lease import StoreLease, prefetch

    shared, other, down = CountingStore(), CountingStore(), CountingStore(down=True)
    leases = [StoreLease(shared), StoreLease(other), StoreLease(shared), StoreLease(down), StoreLease(shared)]
    contexts = [[1], [2, 3], [4], [5], [6, 7]]
    prefetch(leases, contexts, max_nodes=8)
    assert shared.calls == [3] and other.calls == [1] and down.calls == [1]
    got = [lease.draft(c, 8) for lease, c in zip(leases, contexts, strict=True)]
    assert [None if d is None else int(d.tokens[0]) for d in got] == [2, 4, 5, None, 8]


def test_batch_draft_sizes_shrink_as_rows_join() -> None:
    from crest.decoding.policy import batch_draft_sizes

    cpu = CostModel([1, 8, 64, 512], [1.0, 1.5, 6.0, 48.0])  # nearly free up to 8 tokens, then linear
    chain = Draft(np.arange(16), np.arange(-1, 15, dtype=np.int32), np.full(16, 100) - np.arange(16))
    sizes = [batch_draft_sizes([chain] * rows, cpu, acceptance_scale=0.5)[0] for rows in (1, 4, 16, 64)]
    assert sizes[0] > 0 and sizes == sorted(sizes, reverse=True) and sizes[-1] == 0


def test_step_cost_follows_observed_steps_and_shrinks_drafts() -> None:
    from crest.decoding.policy import StepCost, batch_draft_sizes

    prior = CostModel([1, 8, 64, 512], [1.0, 1.5, 6.0, 48.0])
    cost = StepCost(prior)
    assert float(cost(8)) == pytest.approx(1.5)  # nothing observed: the prior
    chain = Draft(np.arange(16), np.arange(-1, 15, dtype=np.int32), np.full(16, 100) - np.arange(16))
    before = batch_draft_sizes([chain] * 4, cost, acceptance_scale=0.5)[0]
    for _ in range(20):  # a batched step of 4 rows costs as the prior says; wider steps cost 4x more
        cost.observe(4, float(prior(4)))
        cost.observe(32, 4 * float(prior(32)))
    assert float(cost(4)) == pytest.approx(float(prior(4)), rel=1e-3)
    assert float(cost(32)) == pytest.approx(4 * float(prior(32)), rel=1e-2)
    after = batch_draft_sizes([chain] * 4, cost, acceptance_scale=0.5)[0]
    assert before > 0 and after < before
    # beyond the widest step observed, that step's cost: a step there is tried, observed and corrects it
    assert float(cost(1000)) == pytest.approx(float(cost(32)), rel=1e-9)
    wide = batch_draft_sizes([chain] * 16, cost, acceptance_scale=0.5)[0]
    cost.observe(16 * (1 + wide), 8 * float(prior(16 * (1 + wide))))  # dearer than thought
    assert float(cost(1000)) == pytest.approx(8 * float(prior(16 * (1 + wide))), rel=1e-9)
    assert batch_draft_sizes([chain] * 16, cost, acceptance_scale=0.5)[0] < wide


@pytest.mark.parametrize("widths", [(1, 5, 6, 9, 17), (1, 3, 7, 12, 24)], ids=["mid-buckets", "bucket-edges"])
def test_step_cost_estimates_the_widths_it_observed(widths: tuple[int, ...]) -> None:
    """vLLM's CPU build: a flat prior, steps that cost 45 ms + 4 ms a draft token. Each power-of-two bucket's ratio
    stands at the widths its steps had: placed at the bucket's lower edge, a step of 5 came out 7% dear."""
    from crest.decoding.policy import StepCost
    from crest.integrations.vllm import PRIOR_COST

    cost = StepCost(PRIOR_COST)
    for _ in range(30):
        for k in widths:
            cost.observe(k, 0.045 + 0.004 * (k - 1))
    for k in widths:
        assert float(cost(k)) == pytest.approx(0.045 + 0.004 * (k - 1), rel=0.02), k


def test_a_policy_that_saw_only_narrow_steps_still_drafts_a_wide_batch_on_an_engine_where_width_is_free() -> None:
    """A vLLM proposer that served one request at a time, then sees 16 (a GPU: 20 ms a step, however wide), with
    chains it is sure of but an acceptance estimate at its floor: it drafts, since the wide step's cost is not known
    to be dear (a CPU-shaped prior extrapolated from narrow steps said it was, and nothing was ever drafted again)."""
    from crest.decoding.policy import DraftPolicy
    from crest.integrations.vllm import PRIOR_COST

    policy = DraftPolicy(budget=32, adaptive=True, cost=PRIOR_COST, packed=True)
    policy.cost()  # the curve is made when first needed: from here on steps are observed
    for _ in range(30):  # one row at a time: 1 + 24 slots or 1, 20 ms each
        policy.observe_cost(25, 0.020)
        policy.observe_cost(1, 0.020)
        policy.observe(accepted=0, predicted=50.0)  # unseen text: little accepted
    assert policy.acceptance_scale == pytest.approx(0.05)
    chain = Draft(np.arange(24), np.arange(-1, 23, dtype=np.int32), np.full(24, 5), 20, 5)  # path probabilities 1
    cut, _ = policy.size([chain] * 16)
    assert all(len(c) == 24 for c in cut)
    policy.observe_cost(16 * 25, 0.020 * 16)  # a CPU after all: the wide step cost 16x
    cut, _ = policy.size([chain] * 16)
    assert all(len(c) == 0 for c in cut)


def test_run_loop_survives_a_failing_step_and_drains(monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    sched = Scheduler(model(), IdTokenizer(), cost=FLAT)
    decode, calls = sched._decode, []

    def flaky() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        decode()

    monkeypatch.setattr(sched, "_decode", flaky)
    stop = threading.Event()
    thread = threading.Thread(target=sched.run, args=(stop,))
    thread.start()
    with pytest.raises(RuntimeError, match="boom"):
        sched.submit(Request([1, 2, 3], max_tokens=5)).result(timeout=30)
    good = sched.submit(Request([1, 2, 3], max_tokens=5))
    sched.close()
    stop.set()  # drain: the request in flight still finishes
    check_exact([1, 2, 3], good.result(timeout=30).result.output_token_ids, 5, torch.float64)
    thread.join(30)
    assert not thread.is_alive()


@pytest.mark.parametrize("seed", [3, 7], ids=["seed3", "seed7"])
def test_a_batch_of_one_takes_the_generators_own_steps(seed: int) -> None:
    """One `DraftPolicy`: a lone row sizes, backs off and probes exactly as the single-sequence generator does."""
    dtype = torch.float64
    prompt = [4, 5, 6, 7] * 3
    cost = CostModel([1, 2, 4, 8], [1.0, 1.3, 1.6, 2.6])  # mild: what pays follows the learned acceptance
    gen = SpeculativeGenerator(model(dtype), IdTokenizer(), cost=cost)
    gen.eos_ids = {VOCAB - 1}
    alone = gen.generate(prompt, drafter=OracleDrafter(prompt, 40, seed, dtype), max_new_tokens=40)
    sched = Scheduler(model(dtype), IdTokenizer(), cost=cost, max_batch=1)
    sched.gen.eos_ids = {VOCAB - 1}
    got = drive(sched, [(0, Request(prompt, max_tokens=40, drafter=OracleDrafter(prompt, 40, seed, dtype)))])[0]
    check_exact(prompt, got.result.output_token_ids, 40, dtype)
    assert got.result.output_token_ids == alone.output_token_ids
    assert got.result.accepted_per_step == alone.accepted_per_step
    assert got.result.draft_tokens == alone.draft_tokens > 0
    assert 0 < alone.forward_passes < alone.new_tokens  # the drafts were verified and some paid


def test_packed_batches_draft_more_than_padded_ones_of_unequal_rows() -> None:
    """vLLM packs rows: a long draft beside empty ones costs its own tokens, not every row padded to it."""
    from crest.decoding.policy import batch_draft_sizes

    chain = Draft(np.arange(8), np.arange(-1, 7, dtype=np.int32), np.array([90, 80, 70, 60, 50, 40, 30, 20]))
    none = Draft(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64))
    cpu = CostModel([1, 4, 16, 64], [0.065, 0.080, 0.125, 0.240])
    drafts = [chain] + [none] * 7
    padded = batch_draft_sizes(drafts, cpu, acceptance_scale=0.8)[0]
    packed = batch_draft_sizes(drafts, cpu, acceptance_scale=0.8, packed=True)[0]
    assert padded < packed
    assert batch_draft_sizes([chain], cpu, acceptance_scale=0.8, packed=True) == batch_draft_sizes(
        [chain], cpu, acceptance_scale=0.8
    )


@pytest.mark.parametrize("sure_first", [True, False], ids=["sure-first", "guess-first"])
def test_a_packed_batch_sizes_each_row_a_repeat_keeps_its_chain_beside_a_guess(sure_first: bool) -> None:
    """vLLM packs rows: a row sure of 16 tokens (a repeat) keeps them while a row on new text keeps its one likely
    node; one cap for both (a padded batch's rule) cuts the repeat or verifies the guess's unlikely tail."""
    from crest.decoding.policy import batch_draft_sizes

    k = 16
    sure = Draft(np.arange(k), np.arange(-1, k - 1, dtype=np.int32), np.full(k, 50), 20, 50)  # path probabilities 1
    guess = Draft(np.arange(k), np.arange(-1, k - 1, dtype=np.int32), np.array([90] + [5] * (k - 1)), 2, 100)
    cpu = CostModel([1, 2, 4, 8, 16, 32], [1.0, 1.1, 1.3, 1.7, 2.5, 4.1])  # a verified token: a tenth of a step
    drafts = [sure, guess] if sure_first else [guess, sure]
    packed = batch_draft_sizes(drafts, cpu, acceptance_scale=0.8, packed=True)
    assert packed == ([k, 1] if sure_first else [1, k])
    padded = batch_draft_sizes(drafts, cpu, acceptance_scale=0.8)
    assert padded[0] == padded[1]  # one cap: both rows alike
