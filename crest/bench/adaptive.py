"""Pricing replayed steps: the pinned forward cost of SmolLM2-135M on this CPU, and the speedup it models.

`crest.bench.replay` replays a drafter with the generator's own `DraftPolicy` and returns the nodes verified per
step; `estimated_speedup` prices those steps with a cost model: new tokens per modelled second against plain
decoding (one token per forward of 1). `QUIET_CPU_COST` is the pinned curve measured for SmolLM2-135M on this CPU
when it was quiet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from crest.decoding.sizing import CostModel

QUIET_CPU_COST = ((1, 4, 16, 64), (0.065, 0.080, 0.125, 0.240))  # sizes, seconds of one SmolLM2-135M forward


def quiet_cpu_cost() -> CostModel:
    """Return the pinned cost model: SmolLM2-135M forward seconds per tree size on this CPU, measured quiet."""
    return CostModel(*QUIET_CPU_COST)


def estimated_speedup(new_tokens: int, nodes: Sequence[int], draft_seconds: Sequence[float], cost: CostModel) -> float:
    """Return new tokens per modelled second (a forward of 1 + nodes per step, plus drafting) over plain decoding."""
    if not nodes:
        return 0.0
    seconds = float(cost(np.asarray(nodes, dtype=np.int64) + 1).sum()) + float(sum(draft_seconds))
    return new_tokens * float(cost(1)) / seconds if seconds > 0 else 0.0
