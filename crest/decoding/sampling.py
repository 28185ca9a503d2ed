"""Lossless acceptance of a draft tree: greedy (the target's argmax) and sampled (the target's own draws).

Both rules walk the tree from the root: at each visited node the target picks one token, and the walk
moves to the child holding that token or stops and emits it. With sampling, the token at every node is
drawn from the target's processed distribution at that node (temperature, then top-k, then top-p, as
`transformers` applies them); since each node is visited at most once and its draw depends only on its
own distribution, the draws are made for all nodes at once and the emitted sequence has exactly the
distribution of plain sampling, whatever the tree.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from crest.errors import ConfigError


def check_sampling(*, temperature: float, top_p: float, top_k: int) -> None:
    """Raise ConfigError unless the sampling options are in range."""
    if not temperature >= 0.0:
        raise ConfigError(f"temperature must be >= 0, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ConfigError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ConfigError(f"top_k must be >= 0 (0 = off), got {top_k}")


def children_of(parent_slot: np.ndarray, tokens: np.ndarray) -> list[dict[int, int]]:
    """Return, for each slot (root first), a map from child token to child slot (the first such child)."""
    kids: list[dict[int, int]] = [{} for _ in range(parent_slot.shape[0] + 1)]
    for slot, parent in enumerate(parent_slot.tolist(), start=1):
        kids[parent].setdefault(int(tokens[slot]), slot)
    return kids


def accept_greedy(predicted: Sequence[int], kids: list[dict[int, int]]) -> tuple[list[int], list[int]]:
    """Return (accepted slots, emitted tokens): follow the target's token at each node while a child matches."""
    slots: list[int] = []
    emitted: list[int] = []
    current = 0
    while True:
        token = int(predicted[current])
        emitted.append(token)
        nxt = kids[current].get(token)
        if nxt is None:
            return slots, emitted
        slots.append(nxt)
        current = nxt


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Return sampling probabilities [N, V] after temperature, top-k and top-p, as `generate` applies them."""
    scores = logits.float() / max(temperature, 1e-6)  # [N, V]
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False  # keep at least the most likely token
        scores = scores.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return scores.softmax(dim=-1)


def sample_nodes(probs: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
    """Return one token drawn independently from each row of `probs` [N, V] (one host transfer)."""
    return torch.multinomial(probs, 1, generator=generator).view(-1).tolist()
