"""The drafting policy: how much of a draft to verify, learned from what was accepted, for one row or a batch.

One `DraftPolicy` holds every rule that decides what the verifier sees, so the single-sequence generator, the
batching scheduler, the replay benchmarks and the vLLM proposer draft alike: ask the drafter (`draft`: a
failing, empty or invalid draft costs that step's draft only, said once), cut it to the budget and to the room
left (`room_left`), then size the batch's drafts (`size`). A batched forward of B rows padded to S slots costs
about `cost(B * S)` (the calibrated single-sequence curve, corrected by observed steps in `StepCost`), so the
policy keeps the common cap k that maximises the batch's expected tokens per second, (B + the rows' expected
accepted nodes within k) / cost(B * (1 + k)); for one row that is the best prefix of its draft. Expected
accepted nodes are the draft's path probabilities times an acceptance scale learned from decayed sums of
accepted and predicted nodes (`observe`, `crest.decoding.acceptance`). When nothing pays, the policy backs off (`skip`:
a few steps without asking the drafters, doubling up to `MAX_BACKOFF`) and now and then verifies a small probe
anyway, since an acceptance estimate that never sees a verified draft cannot learn.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from crest_client.draft import Draft, empty_draft, path_probabilities

from crest.decoding.acceptance import Acceptance
from crest.decoding.sizing import CostModel
from crest.decoding.tree import check_draft, limit_depth
from crest.errors import ConfigError

log = logging.getLogger(__name__)

EXPLORE_EVERY = 16  # steps per row without a verified draft before a small one is verified anyway

EXPLORE_NODES = 4  # at most this many nodes per row in such a probe: enough to learn from, cheap to verify

MAX_BACKOFF = 8  # at most this many steps without drafting after tries at one batch size that did not pay


class StepCost:
    """The calibrated cost curve times the observed ratio of step time to it, per power-of-two token count.

    Each bucket's ratio stands at the mean width its steps had (log2), not at its lower edge: a bucket of 4-7
    tokens observed at 5 and 6 must not say what 4 costs, or the curve runs a bucket ahead of the steps (on a CPU,
    where width costs, a step of 5 was estimated 7% dearer than it was, and chains were cut short).
    """

    BUCKETS = 16  # token counts 1 .. 2^15

    def __init__(self, prior: CostModel, *, decay: float = 0.8) -> None:
        self.prior, self.decay = prior, decay
        self.ratio = np.full(self.BUCKETS, np.nan)  # [buckets] seconds observed / prior seconds, decayed
        self.at = np.full(self.BUCKETS, np.nan)  # [buckets] log2 of the token counts observed there, decayed mean
        self.largest = 0  # the most slots a step observed had
        self._seen = np.zeros(0, dtype=np.int64)  # the buckets observed, ascending
        self._priors: dict[int, float] = {}  # the prior at each token count observed (a proposer observes every step)

    def observe(self, tokens: int, seconds: float) -> None:
        """Record that a step of `tokens` slots (rows x width) took `seconds`."""
        tokens = int(tokens)
        expected = self._priors.get(tokens)
        if expected is None:
            expected = float(self.prior(tokens))
            if len(self._priors) < 4096:
                self._priors[tokens] = expected
        if tokens < 1 or seconds <= 0 or expected <= 0:
            return
        b = min(self.BUCKETS - 1, tokens.bit_length() - 1)
        r, at = seconds / expected, math.log2(tokens)
        self.largest = max(self.largest, tokens)
        old = float(self.ratio[b])
        if old != old:  # NaN: the bucket's first step
            self.ratio[b], self.at[b] = r, at
            self._seen = np.flatnonzero(~np.isnan(self.ratio))
        else:
            self.ratio[b] = self.decay * old + (1.0 - self.decay) * r
            self.at[b] = self.decay * float(self.at[b]) + (1.0 - self.decay) * at

    def __call__(self, k: np.ndarray | int) -> np.ndarray:
        """Return the estimated seconds of a step of `k` slots: the prior, scaled as observed nearby; beyond the
        widest step observed, that step's cost.

        Past what was observed the estimate is optimistic on purpose: a pessimistic one is never corrected (the
        policy would never draft that wide), while a step drafted on an optimistic one is observed and corrects it.
        A prior shaped by a CPU, where width costs, would otherwise keep a GPU's wide steps undrafted forever.
        """
        k = np.asarray(k, dtype=np.float64)
        seen = self._seen
        if not seen.shape[0]:
            return self.prior(k)
        ratios, at = self.ratio[seen], self.at[seen]  # each bucket's ratio at the mean width it was observed at
        if k.size and float(k.max()) > self.largest:  # the widest step observed, last (one call of the prior)
            sizes = np.append(k, float(self.largest))  # [n + 1]
            scale = np.interp(np.log2(np.maximum(sizes, 1.0)), at, ratios)  # nearest beyond the ends
            cost = self.prior(sizes) * scale
            return np.where(k > self.largest, np.minimum(cost[:-1], cost[-1]), cost[:-1]).reshape(k.shape)
        scale = np.interp(np.log2(np.maximum(k, 1.0)), at, ratios)
        return np.asarray(self.prior(k) * scale).reshape(k.shape)


CostSource = CostModel | StepCost | Callable[[], CostModel]


class DraftPolicy:
    """Drafts, sizes and learns for one generator, scheduler or proposer (not thread-safe: one loop owns it)."""

    def __init__(
        self,
        *,
        budget: int = 64,
        adaptive: bool = True,
        cost: CostSource | None = None,
        vocab: int | None = None,
        backoff: bool = True,
        packed: bool = False,
    ) -> None:
        """`cost` is the forward cost curve, or a function that returns it when first needed (a calibration).

        `packed`: the engine packs rows of different widths into one forward (vLLM) instead of padding every
        row to the widest (crest's scheduler), so a step costs the sum of the rows' tokens.
        """
        if budget < 0:
            raise ConfigError(f"the draft budget must be >= 0, got {budget}")
        self.budget, self.adaptive, self.vocab, self.backoff = int(budget), adaptive, vocab, backoff
        self.packed = packed
        self._source = cost
        self._cost: StepCost | None = None
        self.acceptance = Acceptance()  # how much of the verified drafts was accepted, overall and per band
        self._idle = 0  # steps since a draft was last verified
        self._backoff = self._skip = self._skip_rows = 0  # steps to draft nothing after a try that did not pay
        self._warned: set[tuple[str, str]] = set()

    @property
    def acceptance_scale(self) -> float:
        """Return the observed ratio of accepted to weight-predicted draft nodes (0.5 before any step)."""
        return self.acceptance.scale

    @property
    def evidence(self) -> float:
        """Return the decayed number of weight-predicted nodes verified so far (below 2: still exploring)."""
        return self.acceptance.evidence

    @property
    def sized(self) -> bool:
        """Return whether the cost curve was made (a batch was sized): before that, no step cost is known."""
        return self._cost is not None

    def cost(self) -> StepCost:
        """Return the step cost curve (the prior, called when first needed, corrected by `observe_cost`)."""
        if self._cost is None:
            source = self._source
            if source is None:
                raise ConfigError("adaptive draft sizing needs a cost model")
            prior = source if isinstance(source, CostModel | StepCost) else source()
            self._cost = prior if isinstance(prior, StepCost) else StepCost(prior)
        return self._cost

    def draft(self, drafter: Any, context: Sequence[int], *, room: int, chain: bool = False) -> Draft:
        """Return the drafter's tree for the context, cut to the budget and to depth `room` (empty on any failure).

        `chain`: the caller wants the tree's best path only; a drafter that finds it without building the whole
        tree (`draft_chain`, a merged drafter) returns just that path.
        """
        if drafter is None or room <= 0 or self.budget <= 0:
            return empty_draft()
        try:
            direct = getattr(drafter, "draft_chain", None) if chain else None
            tree = drafter.draft(context, self.budget) if direct is None else direct(context, self.budget, depth=room)
            if tree is None or len(tree) == 0:
                return empty_draft()
            if self.vocab is not None:
                check_draft(tree, self.vocab)
        except Exception as exc:  # a failing drafter costs a step's draft, never the generation
            self._warn_once(drafter, exc)
            return empty_draft()
        return limit_depth(tree.truncate(self.budget), room)

    def skip(self, rows: int) -> bool:
        """Return whether to draft nothing this step: drafting did not pay on the last tries at this batch size."""
        if not (self.adaptive and self.backoff) or self._skip <= 0 or rows != self._skip_rows:
            return False
        self._skip -= 1
        self._idle += 1
        return True

    def size(self, drafts: Sequence[Draft]) -> tuple[list[Draft], float]:
        """Return the drafts cut to the sizes that pay for the batch, and their weight-predicted accepted nodes."""
        cut, each = self.size_rows(drafts)
        return cut, float(np.asarray(each, dtype=np.float64).sum())

    def size_rows(self, drafts: Sequence[Draft]) -> tuple[list[Draft], list[float]]:
        """Return the drafts cut to the sizes that pay for the batch, and each one's weight-predicted accepted nodes."""
        drafts = list(drafts)
        if not any(len(d) for d in drafts):
            return drafts, [0.0] * len(drafts)
        within = cumulative_nodes(drafts)  # [B, k+1]
        rows = np.arange(len(drafts))
        if not self.adaptive:
            return drafts, within[rows, [len(d) for d in drafts]].tolist()
        sizes = batch_draft_sizes(drafts, self.cost(), acceptance_scale=self.acceptance.scale, packed=self.packed,
                                  within=within)  # fmt: skip
        paid = any(sizes)
        self._idle = 0 if paid else self._idle + 1
        self._backoff = 0 if paid else min(MAX_BACKOFF, max(1, 2 * self._backoff))
        self._skip, self._skip_rows = self._backoff, len(drafts)
        if not paid and (self.acceptance.evidence < 2.0 or self._idle >= EXPLORE_EVERY * len(drafts)):
            # without verified drafts the acceptance estimate cannot learn: now and then verify a few nodes (less
            # often as the batch grows, since every row then pads to the probe's width)
            sizes, self._idle = [min(len(d), EXPLORE_NODES) for d in drafts], 0
        return [d.truncate(k) for d, k in zip(drafts, sizes, strict=True)], within[rows, sizes].tolist()

    def observe(
        self, *, accepted: int, predicted: float, probabilities: np.ndarray | None = None,
        hits: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Fold one verified step into the acceptance scale: its accepted and weight-predicted draft nodes, and each
        verified node's path probability and whether it was accepted, when known (`chain_hits`)."""
        self.acceptance.observe(accepted=accepted, predicted=predicted, probabilities=probabilities, hits=hits)

    def observe_cost(self, tokens: int, seconds: float) -> None:
        """Record that a forward of `tokens` slots took `seconds` (nothing before sizing first needed the curve)."""
        if self._cost is not None:
            self._cost.observe(tokens, seconds)

    def _warn_once(self, drafter: Any, exc: Exception) -> None:
        key = (type(drafter).__name__, type(exc).__name__)
        level = logging.DEBUG if key in self._warned else logging.WARNING
        self._warned.add(key)
        log.log(level, "drafter %s: %s: %s (no draft this step)", key[0], key[1], exc)


def room_left(*, context_length: int, generated: int, max_new_tokens: int, max_positions: int) -> int:
    """Return the deepest draft path a step may verify: within the model's positions and the tokens still wanted."""
    # a path of depth d needs positions up to past + d and emits d + 1 tokens
    return min(max_positions - context_length - 1, max_new_tokens - generated - 1)


def cumulative_nodes(drafts: Sequence[Draft]) -> np.ndarray:
    """Return [B, k+1]: each draft's weight-predicted accepted nodes among its first 0..k nodes (k: the largest)."""
    top = max((len(d) for d in drafts), default=0)
    prob = np.zeros((len(drafts), top), dtype=np.float64)  # [B, k], zero past each draft's end
    for r, draft in enumerate(drafts):
        if len(draft):
            prob[r, : len(draft)] = path_probabilities(draft)
    within = np.zeros((len(drafts), top + 1), dtype=np.float64)
    np.cumsum(prob, axis=1, out=within[:, 1:])
    return within


def batch_draft_sizes(
    drafts: Sequence[Draft],
    cost: CostModel | StepCost,
    *,
    acceptance_scale: float = 1.0,
    packed: bool = False,
    within: np.ndarray | None = None,
) -> list[int]:
    """Return each row's draft size: what maximises the batch's expected tokens per second.

    A padded batch of B rows costs `cost(B * (1 + widest draft))`, so its rows share one cap; a packed one (vLLM)
    costs `cost(B + sum of the drafts)`, so each row keeps its nodes worth at least one threshold for the batch
    (`_packed_sizes`): a row sure of a long chain (a repeat) keeps it beside one whose next node is a guess.
    `within`: the drafts' `cumulative_nodes`, when the caller has them.
    """
    rows = len(drafts)
    if rows == 0:
        return []
    lengths = np.array([len(d) for d in drafts], dtype=np.int64)
    top = int(lengths.max())
    if top == 0:
        return [0] * rows
    gains = acceptance_scale * (cumulative_nodes(drafts) if within is None else within)  # [B, k+1]
    if packed:
        return _packed_sizes(gains, lengths, cost)
    caps = np.arange(top + 1)
    cut = np.minimum(caps.reshape(-1, 1), lengths.reshape(1, -1))  # [k+1, B] each row's nodes under cap k
    slots = rows + cut.sum(axis=1) if packed else rows * (1 + cut.max(axis=1))  # [k+1] tokens of the forward
    rate = (rows + gains.sum(axis=0)) / cost(slots)
    best = int(np.argmax(rate))  # the first maximum: no draft when nothing pays
    return [int(min(best, n)) for n in lengths.tolist()]


def _packed_sizes(gains: np.ndarray, lengths: np.ndarray, cost: CostModel | StepCost) -> list[int]:
    """Return each packed row's size: its nodes among the batch's n most valuable ones, n the best for the batch.

    Nodes are taken most valuable first (each one's expected accepted tokens); the first n cost `cost(B + n)` and
    bring B + their values, and the n of the most tokens per second wins (the first maximum: nothing drafted when
    nothing pays). A row's values never increase along its draft, so what it keeps is a prefix.
    """
    rows, top = gains.shape[0], gains.shape[1] - 1
    if rows == 1:  # one row (a first-sight request alone): its best prefix, without the sort
        sizes = np.arange(top + 1)
        return [int(np.argmax((1.0 + gains[0]) / cost(1 + sizes)))]
    values = np.diff(gains, axis=1)  # [B, k]
    if int(lengths.min()) == top:  # rows as long as each other (a batch of repeats): no mask
        values, owner = values.reshape(-1), np.repeat(np.arange(rows), top)  # [N] row by row, nodes in order
    else:
        inside = np.arange(top)[None, :] < lengths[:, None]  # [B, k]
        values, owner = values[inside], np.nonzero(inside)[0]
    order = np.argsort(-values, kind="stable")  # ties: the earlier row, and within a row the earlier node
    brought = np.zeros(values.shape[0] + 1)
    np.cumsum(values[order], out=brought[1:])
    rate = (rows + brought) / cost(rows + np.arange(values.shape[0] + 1))
    best = int(np.argmax(rate))
    return np.bincount(owner[order[:best]], minlength=rows).tolist()


def choose_draft_size(draft: Draft, cost: CostModel | StepCost, *, acceptance_scale: float = 1.0) -> int:
    """Return the prefix size k that maximises expected new tokens per second for this draft (0: no draft)."""
    return batch_draft_sizes([draft], cost, acceptance_scale=acceptance_scale)[0]
