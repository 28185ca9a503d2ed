"""The layout of a draft tree for one target forward: breadth-first slots, the 4-D attention mask, position ids.

The root (the last accepted token) takes slot 0 and the draft's nodes follow breadth-first; each node sees the
prefix in the KV cache (within the sliding window, for models that have one), the root and its own ancestors,
at position root + depth. `limit_depth` cuts a draft to the positions left.
"""

from __future__ import annotations

import numpy as np
import torch
from crest_client.draft import Draft


def tree_layout(draft: Draft) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Return (breadth-first order, parent slot in that layout with 0 = root, depth) of the draft's nodes."""
    depth = draft.depths()
    order = np.lexsort((np.arange(len(draft)), depth))  # breadth-first, stable within a depth
    slot = np.empty(len(draft), dtype=np.int64)
    slot[order] = np.arange(1, len(draft) + 1)  # slot 0 is the root
    parents = draft.parents[order]
    parent_slot = np.where(parents >= 0, slot[np.maximum(parents, 0)], 0)
    return order, parent_slot, depth[order]


def tree_mask(parent_slot: np.ndarray) -> np.ndarray:
    """Return the [T+1, T+1] bool mask of root + nodes: each sees the root, itself and its ancestors."""
    size = parent_slot.shape[0]
    laid_out = Draft(np.zeros(size, np.int64), (parent_slot - 1).astype(np.int32), np.zeros(size, np.int64))
    mask = np.zeros((size + 1, size + 1), dtype=bool)  # [T+1, T+1]
    mask[:, 0] = True
    mask[1:, 1:] = laid_out.ancestor_mask()  # the draft's own rule, on the nodes in layout order
    return mask


def additive_mask(
    visible: np.ndarray,
    positions: torch.Tensor,
    past_len: int,
    *,
    dtype: torch.dtype,
    window: int | None = None,
) -> torch.Tensor:
    """Return the [1, 1, S, past+S] additive mask (0 = attend, dtype min = not) of a tree over a cache."""
    device = positions.device
    size = visible.shape[0]
    tree = torch.from_numpy(visible).to(device)  # [S, S]
    if past_len == 0 and window is None:
        allowed = tree
    else:
        prefix = torch.ones((size, past_len), dtype=torch.bool, device=device)  # [S, past]
        allowed = torch.cat((prefix, tree), dim=1)  # [S, past+S]
        if window is not None:
            keys = torch.cat((torch.arange(past_len, device=device), positions[0]))  # [past+S] key positions
            allowed &= positions[0].view(-1, 1) - keys.view(1, -1) < window
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask.view(1, 1, size, -1)


def tree_inputs(
    root: int, draft: Draft, past_len: int, *, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Return (input_ids [1, T+1], position_ids [1, T+1], tokens [T+1], parent slots [T]) of root + tree."""
    order, parent_slot, depth = tree_layout(draft)
    tokens = np.concatenate(([root], draft.tokens[order])).astype(np.int64)  # [T+1] root first
    positions = past_len + np.concatenate(([0], depth)).astype(np.int64)  # [T+1]
    ids = torch.from_numpy(tokens).view(1, -1).to(device)
    pos = torch.from_numpy(positions).view(1, -1).to(device)
    return ids, pos, tokens, parent_slot


def build_tree_inputs(
    root: int,
    draft: Draft,
    past_len: int,
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Return (input_ids [1, T+1], position_ids [1, T+1], mask [1, 1, T+1, past+T+1], tokens, parent slots)."""
    ids, pos, tokens, parent_slot = tree_inputs(root, draft, past_len, device=device)
    mask = additive_mask(tree_mask(parent_slot), pos, past_len, dtype=dtype, window=window)
    return ids, pos, mask, tokens, parent_slot


def limit_depth(draft: Draft, max_depth: int) -> Draft:
    """Return the subtree of nodes at depth <= `max_depth`, in the same order (parents renumbered)."""
    if len(draft) <= max_depth:  # no node can be deeper than the tree has nodes
        return draft
    keep = draft.depths() <= max_depth
    if keep.all():
        return draft
    index = np.cumsum(keep) - 1  # new index of each kept node
    parents = np.where(draft.parents >= 0, index[np.maximum(draft.parents, 0)], -1)[keep]
    return Draft(draft.tokens[keep], parents.astype(np.int32), draft.weights[keep], draft.n, draft.total)


def check_draft(draft: Draft, vocab: int) -> None:
    """Raise ValueError unless `draft` is a well-formed tree over token ids below `vocab`."""
    draft.validate()
    tokens = draft.tokens.tolist() if len(draft) <= 128 else draft.tokens  # few nodes: Python's min/max are cheaper
    if len(draft) and (min(tokens) < 0 or max(tokens) >= vocab):
        raise ValueError(f"a draft token is outside the model's vocabulary of {vocab}")
