"""Draft size that fits the hardware: a measured forward cost per tree size, calibrated once and cached.

A forward of k tree tokens on top of a KV cache costs about the same for small k on a GPU and grows
roughly linearly on a CPU, so the best draft size depends on the device. `calibrate` measures the cost
curve once per model, device, dtype and torch thread count, and keeps it in `$CREST_HOME/calibration/`
so that later runs load it instead of measuring again; `crest.decoding.policy` sizes drafts on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CALIBRATION_SIZES = (1, 2, 4, 8, 16, 32, 64)


class CostModel:
    """Measured seconds of one forward of k tree tokens on top of a cache, for choosing the draft size."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]) -> None:
        self.sizes = np.asarray(sizes, dtype=np.float64)
        # more tokens never cost less, and timing noise only ever adds time: a size costs at most any larger one
        self.seconds = np.minimum.accumulate(np.asarray(seconds, dtype=np.float64)[::-1])[::-1]
        # the slope beyond the largest size (called every step by a proposer: computed once)
        pairs = self.sizes.shape[0] >= 2
        rise = float(self.seconds[-1] - self.seconds[-2]) if pairs else 0.0
        self._slope = max(0.0, rise / float(self.sizes[-1] - self.sizes[-2])) if pairs else 0.0

    def __call__(self, k: np.ndarray | int) -> np.ndarray:
        """Return the estimated seconds of a forward of `k` tokens (linear beyond the largest size measured)."""
        k = np.asarray(k, dtype=np.float64)
        inside = np.interp(k, self.sizes, self.seconds)
        last = float(self.sizes[-1])
        if self.sizes.shape[0] < 2 or not k.size or float(k.max()) <= last:
            return inside
        return np.where(k > last, float(self.seconds[-1]) + self._slope * (k - last), inside)

    def to_json(self) -> dict[str, list[float]]:
        """Return the measured curve as a JSON-ready dict."""
        return {"sizes": self.sizes.tolist(), "seconds": self.seconds.tolist()}


_COSTS: weakref.WeakKeyDictionary[Any, dict[str, CostModel]] = weakref.WeakKeyDictionary()


def calibrate(
    model: Any,
    *,
    sizes: Sequence[int] = CALIBRATION_SIZES,
    context: int = 256,
    repeats: int = 3,
    on_progress: Callable[[str], None] | None = None,
) -> CostModel:
    """Return the model's cost curve: known in this process, else cached in CREST_HOME, else measured and saved.

    `on_progress` receives one line before a measurement (a minute or two on a CPU) and one after each of its
    rounds over the sizes; the first line is also logged at INFO on the `crest.decoding.sizing` logger.
    """
    key = calibration_key(model, sizes=sizes, context=context, repeats=repeats)
    path = calibration_path(key)
    known = _COSTS.setdefault(model, {})
    if path.name not in known:
        cost = _load(path, key)
        if cost is None:
            line = (
                f"calibrating the draft cost model for {key['model']} on {key['device']}/{key['dtype']} "
                f"with {key['threads']} threads (once per model, device, dtype and thread count)..."
            )
            log.info(line)
            if on_progress is not None:
                on_progress(line)
            cost = measure_costs(model, sizes=sizes, context=context, repeats=repeats, on_round=on_progress)
            _save(path, key, cost)
        known[path.name] = cost
    return known[path.name]


def calibration_key(model: Any, *, sizes: Sequence[int], context: int, repeats: int) -> dict[str, Any]:
    """Return what a cost curve depends on: the model (name, config hash, parameters), device, dtype, threads."""
    param = next(model.parameters())
    config = model.config
    settings = config.to_dict() | {"attention": getattr(config, "_attn_implementation", None)}
    settings.pop("_name_or_path", None)
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    device = str(param.device)
    if param.device.type == "cuda":
        device += f" ({torch.cuda.get_device_name(param.device)})"
    return {
        "model": str(getattr(config, "name_or_path", "") or config.model_type),
        "config": digest[:16],
        "parameters": sum(p.numel() for p in model.parameters()),
        "device": device,
        "dtype": str(param.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "sizes": [int(k) for k in sizes],
        "context": int(context),
        "repeats": int(repeats),
    }


def calibration_path(key: dict[str, Any]) -> Path:
    """Return the cache file of a calibration key: CREST_HOME/calibration/<model>-<hash of the key>.json."""
    from crest_client.embedded import crest_home

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(key["model"]).name or "model")[:60]
    return crest_home() / "calibration" / f"{slug}-{digest}.json"


def _load(path: Path, key: dict[str, Any]) -> CostModel | None:
    """Return the cached curve at `path` when it was measured under `key` (None: absent, stale or unreadable)."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
        if saved.get("key") != key:
            return None
        return CostModel(saved["sizes"], saved["seconds"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _save(path: Path, key: dict[str, Any], cost: CostModel) -> None:
    """Write the curve with its key atomically (a temporary file renamed); a failure only costs the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False, encoding="utf-8") as f:
            json.dump({"key": key, **cost.to_json()}, f, indent=1)
        os.replace(f.name, path)
    except OSError as exc:
        log.warning("cannot cache the draft cost model in %s: %s", path.parent, exc)


def measure_costs(
    model: Any,
    *,
    sizes: Sequence[int],
    context: int,
    repeats: int,
    on_round: Callable[[str], None] | None = None,
) -> CostModel:
    """Measure the best of `repeats` forward times of k tokens after a cache of `context` tokens, per size k.

    `on_round` receives a line after each round over the sizes (`calibrating: round 2 of 3 done, 41 s`).
    """
    from transformers import DynamicCache

    param = next(model.parameters())
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
        start = time.perf_counter()
        rounds = max(1, repeats)
        for done in range(1, rounds + 1):  # rounds over all sizes: a burst of load spoils one round, not one size
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
            if on_round is not None:
                on_round(f"calibrating: round {done} of {rounds} done, {time.perf_counter() - start:.0f} s")
    return CostModel(sizes, [best[k] for k in sizes])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
