"""Draft size that fits the hardware: a measured forward cost per tree size and the best prefix of a draft.

A forward of k tree tokens on top of a KV cache costs about the same for small k on a GPU and grows
roughly linearly on a CPU, so the best draft size depends on the device. `calibrate` measures the cost
curve once per (model, device, dtype) in this process; `choose_draft_size` estimates each node's
acceptance probability from the draft's weights (products of weight / parent-weight ratios along the
path, scaled by an observed correction) and keeps the prefix slice that maximises expected new tokens
per second: (1 + sum of the prefix's path probabilities) / cost(k + 1).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)


class CostModel:
    """Measured seconds of one forward of k tree tokens on top of a cache, for choosing the draft size."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]) -> None:
        self.sizes = np.asarray(sizes, dtype=np.float64)
        # more tokens never cost less, and timing noise only ever adds time: a size costs at most any larger one
        self.seconds = np.minimum.accumulate(np.asarray(seconds, dtype=np.float64)[::-1])[::-1]

    def __call__(self, k: np.ndarray | int) -> np.ndarray:
        """Return the estimated seconds of a forward of `k` tokens (linear beyond the largest size measured)."""
        k = np.asarray(k, dtype=np.float64)
        inside = np.interp(k, self.sizes, self.seconds)
        if self.sizes.shape[0] < 2:
            return inside
        slope = max(0.0, (self.seconds[-1] - self.seconds[-2]) / (self.sizes[-1] - self.sizes[-2]))
        return np.where(k > self.sizes[-1], self.seconds[-1] + slope * (k - self.sizes[-1]), inside)

    def to_json(self) -> dict[str, list[float]]:
        """Return the measured curve as a JSON-ready dict."""
        return {"sizes": self.sizes.tolist(), "seconds": self.seconds.tolist()}


_COSTS: weakref.WeakKeyDictionary[Any, dict[tuple[str, str], CostModel]] = weakref.WeakKeyDictionary()


def calibrate(
    model: Any, *, sizes: Sequence[int] = CALIBRATION_SIZES, context: int = 256, repeats: int = 3
) -> CostModel:
    """Measure (once per model, device and dtype) the forward time of k tokens after a cache of `context`."""
    param = next(model.parameters())
    ident = (str(param.device), str(param.dtype))
    known = _COSTS.setdefault(model, {})
    if ident in known:
        return known[ident]
    from transformers import DynamicCache

    vocab = int(model.config.vocab_size)
    limit = int(getattr(model.config, "max_position_embeddings", None) or 1 << 20)
    sizes = sorted({max(1, min(int(k), limit // 2)) for k in sizes})
    context = max(1, min(context, limit - max(sizes)))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context), generator=gen).to(param.device)
    best = {k: float("inf") for k in sizes}
    with torch.no_grad():
        cache: Any = DynamicCache()
        model(ids, past_key_values=cache, use_cache=True)
        for _ in range(max(1, repeats)):  # rounds over all sizes: a burst of load spoils one round, not one size
            for k in sizes:
                step = torch.randint(0, vocab, (1, k), generator=gen).to(param.device)
                pos = torch.arange(context, context + k, device=param.device).view(1, -1)
                _synchronize(param.device)
                t0 = time.perf_counter()
                model(step, past_key_values=cache, position_ids=pos, use_cache=True)
                _synchronize(param.device)
                best[k] = min(best[k], time.perf_counter() - t0)
                for layer in cache.layers:  # drop the k entries just added
                    layer.keys, layer.values = layer.keys[:, :, :context], layer.values[:, :, :context]
    seconds = [best[k] for k in sizes]
    known[ident] = CostModel(sizes, seconds)
    return known[ident]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def path_probabilities(draft: Draft) -> np.ndarray:
    """Return each node's estimated probability of being accepted: weight / parent-weight products, at most 1.

    A root child's share is its weight over `draft.total` when that is set and larger than the root children's sum.
    """
    weights = np.maximum(draft.weights.astype(np.float64), 0.0)  # [T]
    roots = draft.parents < 0
    total = max(float(weights[roots].sum()), float(draft.total)) or 1.0
    prob = np.zeros(len(draft), dtype=np.float64)  # [T]
    parents = draft.parents.tolist()
    for i, p in enumerate(parents):
        if p < 0:
            prob[i] = weights[i] / total
        else:
            prob[i] = prob[p] * (min(1.0, weights[i] / weights[p]) if weights[p] > 0 else 0.0)
    return prob


def choose_draft_size(draft: Draft, cost: CostModel, *, acceptance_scale: float = 1.0) -> int:
    """Return the prefix size k that maximises expected new tokens per second for this draft (0: no draft)."""
    if len(draft) == 0:
        return 0
    gain = np.cumsum(acceptance_scale * path_probabilities(draft))  # [T] expected accepted nodes of each prefix
    k = np.arange(1, len(draft) + 1)
    rate = (1.0 + gain) / cost(k + 1)
    best = int(np.argmax(rate))
    return int(k[best]) if rate[best] > 1.0 / float(cost(1)) else 0


def expected_accepted(draft: Draft) -> float:
    """Return the weight-predicted number of accepted nodes of the whole draft."""
    return float(path_probabilities(draft).sum())
