"""Replay with the adaptive draft size: each step verifies the prefix of the tree the generator's sizing would keep.

`SpeculativeGenerator` cuts every draft to the prefix that `choose_draft_size` says pays for its verification under
the forward cost model, scaled by an acceptance correction learned from the steps it verified (decayed sums of
accepted and weight-predicted nodes), and verifies a small probe now and then when nothing pays. `AdaptiveSizer`
keeps that state and makes those choices without a model (one sizer per drafter, kept across the requests of a
stream as one generator is across a server's requests); `replay_sized` is `crest.bench.accept.replay` with the tree
cut to the sizer's choice (without a sizer: the whole tree, as `replay`), and also returns the nodes verified per
step, so that the cost model can price the steps: `estimated_speedup` is new tokens per modelled second against
plain decoding (one token per forward of 1). `QUIET_CPU_COST` is the pinned curve measured for SmolLM2-135M on this
CPU when it was quiet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from crest_client.draft import Draft

from crest.bench.accept import matched_depth
from crest.decoding.generator import EXPLORE_EVERY, EXPLORE_NODES
from crest.decoding.sizing import CostModel, choose_draft_size, path_probabilities
from crest.decoding.tree import limit_depth
from crest.drafters.protocol import Drafter

QUIET_CPU_COST = ((1, 4, 16, 64), (0.065, 0.080, 0.125, 0.240))  # sizes, seconds of one SmolLM2-135M forward
_DECAY = 0.95  # the generator's decay of its accepted / predicted sums


def quiet_cpu_cost() -> CostModel:
    """Return the pinned cost model: SmolLM2-135M forward seconds per tree size on this CPU, measured quiet."""
    return CostModel(*QUIET_CPU_COST)


class AdaptiveSizer:
    """The generator's draft sizing and acceptance correction, without its model."""

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.accepted, self.predicted = 0.0, 0.0
        self.idle = 0

    @property
    def acceptance_scale(self) -> float:
        """Return the observed ratio of accepted to weight-predicted nodes, as the generator clips it."""
        return float(np.clip((self.accepted + 0.5) / (self.predicted + 1.0), 0.05, 1.5))

    def size(self, draft: Draft) -> int:
        """Return how many of the draft's nodes the generator would verify."""
        size = choose_draft_size(draft, self.cost, acceptance_scale=self.acceptance_scale)
        self.idle = 0 if size else self.idle + 1
        if not size and (self.predicted < 2.0 or self.idle >= EXPLORE_EVERY):
            trusted = choose_draft_size(draft, self.cost, acceptance_scale=1.0)
            size, self.idle = max(1, min(trusted, EXPLORE_NODES)), 0
        return size

    def observe(self, accepted: int, predicted: float) -> None:
        """Fold one verified draft's accepted and predicted nodes into the correction."""
        self.accepted = _DECAY * self.accepted + accepted
        self.predicted = _DECAY * self.predicted + predicted


@dataclass
class SizedReplay:
    """A replay with the adaptive size: tokens, steps, nodes verified per step and draft latencies."""

    new_tokens: int
    steps: int
    nodes: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)


def replay_sized(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    sizer: AdaptiveSizer | None = None,
    max_nodes: int = 64,
    max_new_tokens: int = 128,
    max_positions: int = 1 << 30,
) -> SizedReplay:
    """Replay greedy verification of `drafter`'s trees (cut to the sizer's choice) against the known continuation."""
    prompt, out = [int(t) for t in prompt_ids], [int(t) for t in output_ids]
    done, steps, nodes, latencies = 0, 0, [], []
    while done < len(out):
        context = prompt + out[:done]
        room = min(max_positions - len(context) - 1, max_new_tokens - done - 1)
        t0 = time.perf_counter()
        draft = drafter.draft(context, max_nodes) if room > 0 else None
        latencies.append(time.perf_counter() - t0)
        accepted, size = 0, 0
        if draft is not None and len(draft):
            draft = limit_depth(draft.truncate(max_nodes), room)
            size = sizer.size(draft) if sizer is not None else len(draft)
            if size and sizer is not None:
                predicted = float(path_probabilities(draft)[:size].sum())  # normalised over the whole draft
                accepted = matched_depth(draft.truncate(size), out[done:])
                sizer.observe(accepted, predicted)
            elif size:
                accepted = matched_depth(draft, out[done:])
        done += min(accepted, len(out) - done - 1) + 1
        steps += 1
        nodes.append(size)
    return SizedReplay(len(out), steps, nodes, latencies)


def estimated_speedup(new_tokens: int, nodes: Sequence[int], draft_seconds: Sequence[float], cost: CostModel) -> float:
    """Return new tokens per modelled second (a forward of 1 + nodes per step, plus drafting) over plain decoding."""
    if not nodes:
        return 0.0
    seconds = float(cost(np.asarray(nodes, dtype=np.int64) + 1).sum()) + float(sum(draft_seconds))
    return new_tokens * float(cost(1)) / seconds if seconds > 0 else 0.0
