"""Replay: the M of the real loop without the model, by greedy verification against a known continuation.

Greedy verification accepts exactly the longest draft path that matches the greedy continuation, so replaying a
drafter on the contexts of the known continuation, with the verifier's tree cut (`max_nodes` nodes, depth within
the tokens left), gives the steps of the real loop without running the model again. With a `DraftPolicy` each
step verifies what the generator's own policy would (sized, backed off, probed; one policy per drafter, kept across
the requests of a stream as one generator is across a server's requests); without one, the whole tree. A drafter
that queries with the target's hidden states (the dense ones) is handed, before each draft, the state that predicted
the context's last token, taken from one plain forward over prompt and continuation (`reference_hidden`): what the
generator hands it after a verify forward, up to the tree mask's rounding.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from crest_client.draft import Draft, empty_draft

from crest.decoding.drafter import Drafter
from crest.decoding.hidden import feed_hidden, final_hidden, wants_hidden
from crest.decoding.policy import DraftPolicy, room_left
from crest.decoding.tree import limit_depth
from crest.drafters.trie import match_path


def matched_depth(draft: Draft, truth: Sequence[int]) -> int:
    """Return the depth of the longest draft path equal to a prefix of `truth` (what greedy verification accepts)."""
    return len(match_path(draft, truth))


def reference_hidden(model: object, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> np.ndarray:
    """Return the last hidden state [N, H] at every position of prompt + continuation (row i predicted token i + 1)."""
    import torch

    device = next(model.parameters()).device  # type: ignore[attr-defined]
    ids = torch.tensor([[*map(int, prompt_ids), *map(int, output_ids)]], device=device)  # [1, N]
    return final_hidden(model, ids)[0].float().cpu().numpy()


@dataclass
class Replay:
    """The steps a drafter's replay took over one continuation: nodes verified per step, draft latencies."""

    new_tokens: int
    steps: int
    draft_seconds: list[float] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)


def replay(
    drafter: Drafter,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    *,
    policy: DraftPolicy | None = None,
    max_nodes: int = 64,
    max_new_tokens: int = 128,
    max_positions: int = 1 << 30,
    hidden: np.ndarray | None = None,
) -> Replay:
    """Replay greedy verification of `drafter`'s trees (sized by `policy`, else whole) on the known continuation.

    `hidden` ([N, H], `reference_hidden`) is fed to a drafter that queries with hidden states before each draft.
    """
    prompt, out = [int(t) for t in prompt_ids], [int(t) for t in output_ids]
    done, steps, nodes, latencies = 0, 0, [], []
    fed = hidden is not None and wants_hidden(drafter)
    while done < len(out):
        context = prompt + out[:done]
        if fed:
            assert hidden is not None
            feed_hidden(drafter, len(context), hidden[len(context) - 2] if len(context) >= 2 else None)
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
    return Replay(len(out), steps, latencies, nodes)
