"""The batched tree forward: one target forward for many requests, each row with its own tree, mask and KV rows.

The batch keeps one key/value tensor per layer, `[B, H, L, D]`, and a boolean key mask `valid [B, L]`: a row's
cache entries need not be contiguous, since a query only attends to the keys its mask allows and each key was
rotated at its own position when it was written. A step appends S = largest tree + 1 slots to every row (a
smaller tree is padded with dummy slots that see only the root and themselves, so nothing is ever fully masked),
with a 4-D additive mask `[B, 1, S, L+S]` (each slot sees its row's valid prefix, the root and its ancestors)
and position ids `[B, S]` = the row's root position + depth. After acceptance each row's root and accepted slots
are moved right after the old end (one gather per layer over the S new slots), the cache is cut to the longest
row's share and the other rows' surplus marked invalid; when the holes grow to half the cache it is compacted
(each row's valid entries gathered, left-padded). A new request is prefilled alone and merged with padding; a
finished row is dropped. Only full-attention models are batched: sliding windows are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft

from crest.decoding.models import check_supported
from crest.decoding.tree import tree_inputs, tree_mask
from crest.errors import ModelError

COMPACT_SLACK = 64  # surplus entries tolerated beyond the longest row (plus half its length) before compacting


@dataclass
class TreeRow:
    """One row's input to a batched step: its root (last accepted token, not cached) and draft tree."""

    root: int
    draft: Draft


def check_batchable(model: Any) -> None:
    """Raise ModelError unless the model is supported by the verifier and attends fully (no sliding window)."""
    check_supported(model)
    config = model.config
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    sliding = "sliding_attention" in layer_types or (config.model_type == "mistral" and window)
    if window and sliding:
        raise ModelError(
            "continuous batching supports full-attention models only; this model has a sliding window "
            f"of {window} tokens (serve it with --max-batch 1 is not enough: use crest generate)"
        )


class BatchCache:
    """The KV cache of a batch of requests: per-layer `[B, H, L, D]` tensors and a `[B, L]` valid-key mask."""

    def __init__(self, model: Any) -> None:
        check_batchable(model)
        self.model = model
        config = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.mask_dtype = self.dtype if self.dtype.is_floating_point else torch.float32
        self.layers = int(config.num_hidden_layers)
        heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads)
        empty = torch.zeros((0, heads, 0, head_dim), dtype=self.dtype, device=self.device)
        self.keys: list[torch.Tensor] = [empty] * self.layers  # each [B, H, L, D]
        self.values: list[torch.Tensor] = [empty] * self.layers
        self.valid = torch.zeros((0, 0), dtype=torch.bool, device=self.device)  # [B, L]
        self.lengths: list[int] = []  # valid entries per row: the row's context length - 1

    @property
    def rows(self) -> int:
        """Return the number of rows in the batch."""
        return len(self.lengths)

    @property
    def length(self) -> int:
        """Return the cache's physical length L (valid entries and holes)."""
        return int(self.valid.shape[1])

    @torch.no_grad()
    def prefill(self, prompt: Sequence[int]) -> int:
        """Prefill the prompt but its last token alone (as one request would be), add it as a row; return its index."""
        from transformers import DynamicCache

        cache: Any = DynamicCache(config=self.model.config)
        n = len(prompt) - 1
        if n > 0:
            ids = torch.tensor([list(prompt[:-1])], device=self.device)  # [1, P-1]
            self.model(ids, past_key_values=cache, use_cache=True)
            keys = [layer.keys for layer in cache.layers]
            values = [layer.values for layer in cache.layers]
        else:
            keys = [k.new_zeros((1, k.shape[1], 0, k.shape[3])) for k in self.keys]
            values = [v.new_zeros((1, v.shape[1], 0, v.shape[3])) for v in self.values]
        self._append(keys, values, n)
        return self.rows - 1

    def _append(self, keys: list[torch.Tensor], values: list[torch.Tensor], n: int) -> None:
        """Merge a single row's cache of n entries into the batch, left-padding whichever is shorter."""
        length = max(self.length, n)
        self.keys = [
            torch.cat((_left_pad(b, length), _left_pad(r, length))) for b, r in zip(self.keys, keys, strict=True)
        ]
        self.values = [
            torch.cat((_left_pad(b, length), _left_pad(r, length))) for b, r in zip(self.values, values, strict=True)
        ]
        row = torch.zeros((1, length), dtype=torch.bool, device=self.device)
        row[0, length - n :] = True
        grown = torch.zeros((self.rows, length), dtype=torch.bool, device=self.device)
        grown[:, length - self.length :] = self.valid
        self.valid = torch.cat((grown, row))
        self.lengths.append(n)

    def remove(self, rows: Sequence[int]) -> None:
        """Drop the given rows from the batch."""
        if not rows:
            return
        gone = set(rows)
        keep = [i for i in range(self.rows) if i not in gone]
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        self.keys = [k.index_select(0, index) for k in self.keys]
        self.values = [v.index_select(0, index) for v in self.values]
        self.valid = self.valid.index_select(0, index)
        self.lengths = [self.lengths[i] for i in keep]
        if keep:
            self._trim()
        else:
            self.valid = self.valid[:, :0]
            self.keys = [k[:, :, :0] for k in self.keys]
            self.values = [v[:, :, :0] for v in self.values]

    @torch.no_grad()
    def forward(self, trees: Sequence[TreeRow]) -> tuple[torch.Tensor, list[np.ndarray], list[np.ndarray]]:
        """Run every row's root + tree in one forward; return (logits [B, S, V], tokens and parent slots per row)."""
        from transformers import DynamicCache

        if len(trees) != self.rows:
            raise ValueError(f"{len(trees)} trees for a batch of {self.rows} rows")
        size = 1 + max(len(t.draft) for t in trees)  # S
        rows, past = self.rows, self.length
        ids = torch.zeros((rows, size), dtype=torch.long)  # [B, S]
        pos = torch.zeros((rows, size), dtype=torch.long)  # [B, S]
        visible = np.zeros((rows, size, size), dtype=bool)  # [B, S, S] tree part of the mask
        tokens, parents = [], []
        for r, tree in enumerate(trees):
            row_ids, row_pos, row_tokens, parent_slot = tree_inputs(tree.root, tree.draft, self.lengths[r])
            width = row_ids.shape[1]
            ids[r, :width], ids[r, width:] = row_ids[0], tree.root
            pos[r, :width], pos[r, width:] = row_pos[0], self.lengths[r]
            visible[r, :width, :width] = tree_mask(parent_slot)
            visible[r, width:, 0] = True
            visible[r, np.arange(width, size), np.arange(width, size)] = True  # a pad slot sees the root and itself
            tokens.append(row_tokens)
            parents.append(parent_slot)
        allowed = torch.cat(
            (self.valid.view(rows, 1, past).expand(rows, size, past), torch.from_numpy(visible).to(self.device)), dim=2
        )  # [B, S, L+S]
        mask = torch.zeros(allowed.shape, dtype=self.mask_dtype, device=self.device)
        mask.masked_fill_(~allowed, torch.finfo(self.mask_dtype).min)
        cache: Any = DynamicCache(config=self.model.config)
        for layer, k, v in zip(cache.layers, self.keys, self.values, strict=True):
            layer.lazy_initialization(k, v)
            layer.keys, layer.values = k, v
        out = self.model(
            ids.to(self.device),
            past_key_values=cache,
            attention_mask=mask.view(rows, 1, size, past + size),
            position_ids=pos.to(self.device),
            use_cache=True,
        )
        self.keys = [layer.keys for layer in cache.layers]  # [B, H, L+S, D]
        self.values = [layer.values for layer in cache.layers]
        return out.logits, tokens, parents

    def commit(self, accepted: Sequence[Sequence[int]]) -> None:
        """Keep each row's root and accepted slots (in path order) after the old end; cut the rest."""
        past = self.length
        keep = 1 + max((len(a) for a in accepted), default=0)
        index = np.zeros((self.rows, keep), dtype=np.int64)  # [B, keep] slot of each kept entry, 0 = root
        for r, slots in enumerate(accepted):
            index[r, 1 : 1 + len(slots)] = slots
            self.lengths[r] += 1 + len(slots)
        gather = torch.from_numpy(index + past).to(self.device)
        self.keys = [_keep(k, gather, past) for k in self.keys]
        self.values = [_keep(v, gather, past) for v in self.values]
        counts = torch.tensor([1 + len(a) for a in accepted], device=self.device)
        fresh = torch.arange(keep, device=self.device).view(1, -1) < counts.view(-1, 1)  # [B, keep]
        self.valid = torch.cat((self.valid, fresh), dim=1)
        self._trim()

    def _trim(self) -> None:
        """Compact when holes exceed half the cache (plus slack): each row's valid entries, left-padded."""
        longest = max(self.lengths, default=0)
        if self.length - longest <= COMPACT_SLACK + longest // 2:
            return
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, -longest:] if longest else None
        if order is None:
            self.valid = self.valid[:, :0]
            self.keys = [k[:, :, :0] for k in self.keys]
            self.values = [v[:, :, :0] for v in self.values]
            return
        # a stable sort puts each row's invalid entries first and its valid ones last, in their order: left-padded
        self.keys = [_gather_keys(k, order) for k in self.keys]
        self.values = [_gather_keys(v, order) for v in self.values]
        self.valid = self.valid.gather(1, order)


def _left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """Return x [B, H, n, D] left-padded with zeros to `length` entries."""
    missing = length - x.shape[2]
    if missing <= 0:
        return x
    return torch.cat((x.new_zeros((x.shape[0], x.shape[1], missing, x.shape[3])), x), dim=2)


def _gather_keys(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Return x [B, H, L, D] at the per-row positions index [B, K]: [B, H, K, D]."""
    b, h, _, d = x.shape
    return x.gather(2, index.view(b, 1, -1, 1).expand(b, h, index.shape[1], d))


def _keep(x: torch.Tensor, gather: torch.Tensor, past: int) -> torch.Tensor:
    """Return x [B, H, L+S, D] cut to L + keep, the kept slots (gather [B, keep], absolute) moved to L."""
    kept = _gather_keys(x, gather)  # [B, H, keep, D]
    x[:, :, past : past + kept.shape[2]] = kept
    return x[:, :, : past + kept.shape[2]]
