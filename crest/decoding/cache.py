"""KV-cache edits after a verified step: keep the accepted path's entries, moved into place, drop the rest."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def compact_cache(cache: Any, past_len: int, slots: Sequence[int]) -> None:
    """Keep the prefix, the root and the accepted slots' KV entries (moved into place, in path order)."""
    keep = len(slots)
    for layer in cache.layers:
        if keep:
            src = torch.tensor([past_len + s for s in slots], dtype=torch.long).to(layer.keys.device)
            layer.keys[:, :, past_len + 1 : past_len + 1 + keep] = layer.keys.index_select(2, src)
            layer.values[:, :, past_len + 1 : past_len + 1 + keep] = layer.values.index_select(2, src)
        layer.keys = layer.keys[:, :, : past_len + 1 + keep]
        layer.values = layer.values[:, :, : past_len + 1 + keep]


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of every layer's keys and values."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
