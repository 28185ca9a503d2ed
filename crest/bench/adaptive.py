"""Replay with the adaptive draft size: each step verifies the prefix of the tree the generator's policy would keep.

`SpeculativeGenerator` drafts through a `crest.decoding.policy.DraftPolicy`: it cuts every draft to the prefix that
pays for its verification under the forward cost model, scaled by an acceptance correction learned from the steps
it verified, backs off when nothing pays and verifies a small probe now and then. `replay_sized` is
`crest.bench.accept.replay` driven by such a policy without a model (one policy per drafter, kept across the
requests of a stream as one generator is across a server's requests; without one: the whole tree, as `replay`),
and also returns the nodes verified per step, so that the cost model can price the steps: `estimated_speedup` is
new tokens per modelled second against plain decoding (one token per forward of 1). `QUIET_CPU_COST` is the pinned
curve measured for SmolLM2-135M on this CPU when it was quiet.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from crest_client.draft import empty_draft

from crest.bench.accept import matched_depth
from crest.decoding.policy import DraftPolicy, room_left
from crest.decoding.sizing import CostModel
from crest.decoding.tree import limit_depth
from crest.drafters.protocol import Drafter

QUIET_CPU_COST = ((1, 4, 16, 64), (0.065, 0.080, 0.125, 0.240))  # sizes, seconds of one SmolLM2-135M forward


def quiet_cpu_cost() -> CostModel:
    """Return the pinned cost model: SmolLM2-135M forward seconds per tree size on this CPU, measured quiet."""
    return CostModel(*QUIET_CPU_COST)


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
    policy: DraftPolicy | None = None,
    max_nodes: int = 64,
    max_new_tokens: int = 128,
    max_positions: int = 1 << 30,
) -> SizedReplay:
    """Replay greedy verification of `drafter`'s trees (sized by the policy) against the known continuation."""
    prompt, out = [int(t) for t in prompt_ids], [int(t) for t in output_ids]
    done, steps, nodes, latencies = 0, 0, [], []
    while done < len(out):
        context = prompt + out[:done]
        room = room_left(
            context_length=len(context), generated=done, max_new_tokens=max_new_tokens, max_positions=max_positions
        )
        t0 = time.perf_counter()
        if policy is not None:
            tree = empty_draft() if policy.skip(1) else policy.draft(drafter, context, room=room)
            latencies.append(time.perf_counter() - t0)
            (tree,), predicted = policy.size([tree])
            accepted = matched_depth(tree, out[done:]) if len(tree) else 0
            if len(tree):
                policy.observe(accepted=accepted, predicted=predicted)
        else:
            found = drafter.draft(context, max_nodes) if room > 0 else None
            latencies.append(time.perf_counter() - t0)
            tree = limit_depth(found.truncate(max_nodes), room) if found is not None and len(found) else empty_draft()
            accepted = matched_depth(tree, out[done:]) if len(tree) else 0
        done += min(accepted, len(out) - done - 1) + 1
        steps += 1
        nodes.append(len(tree))
    return SizedReplay(len(out), steps, nodes, latencies)


def estimated_speedup(new_tokens: int, nodes: Sequence[int], draft_seconds: Sequence[float], cost: CostModel) -> float:
    """Return new tokens per modelled second (a forward of 1 + nodes per step, plus drafting) over plain decoding."""
    if not nodes:
        return 0.0
    seconds = float(cost(np.asarray(nodes, dtype=np.int64) + 1).sum()) + float(sum(draft_seconds))
    return new_tokens * float(cost(1)) / seconds if seconds > 0 else 0.0
