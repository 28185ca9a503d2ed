"""The target's last hidden state (the LM head's input) for drafters that query with it, and the model's fingerprint.

A drafter that wants hidden states (the dense drafter) has `observe_hidden(context_length, hidden)`; the
generator then taps the model once (`hidden_tap`: a forward pre-hook on the output embeddings that keeps a
reference to their input, no copy and no extra forward) and, before each draft, hands the drafter the state
that predicted the context's last token: the last prefill position, then the last accepted slot of each
verify forward. `crest serve`'s scheduler shares the same tap over its batched forward ([B, S, H]: `rows` picks
each row's slot). The hook reads and never changes the forward, so greedy output is unchanged. `final_hidden`
computes the same states for plain token windows without the LM head (the dense ingest). `model_fingerprint`
names a model by its shape and a sample of its weights, so a dense part refuses states of another model.
"""

from __future__ import annotations

import hashlib
import weakref
from typing import Any

import numpy as np
import torch

_TAPS: weakref.WeakKeyDictionary[Any, HiddenTap] = weakref.WeakKeyDictionary()


class HiddenTap:
    """Keeps the input of a model's LM head from its latest forward ([B, T, H], a reference)."""

    def __init__(self, model: Any) -> None:
        self.last: torch.Tensor | None = None
        self._handle = model.get_output_embeddings().register_forward_pre_hook(self._keep)

    def _keep(self, module: Any, args: tuple[Any, ...]) -> None:
        self.last = args[0]

    def row(self, slot: int) -> np.ndarray | None:
        """Return the hidden state [H] at `slot` of the latest forward (float32), or None before any."""
        if self.last is None:
            return None
        return self.last[0, slot].detach().float().cpu().numpy()

    def rows(self, rows: list[int], slots: list[int]) -> np.ndarray | None:
        """Return the hidden states [R, H] at (row, slot) pairs of the latest batched forward, or None before any."""
        if self.last is None:
            return None
        device = self.last.device
        picked = self.last[torch.tensor(rows, device=device), torch.tensor(slots, device=device)]  # [R, H]
        return picked.detach().float().cpu().numpy()

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


def wants_hidden(drafter: object) -> bool:
    """Return whether the drafter queries with the target's hidden states."""
    return drafter is not None and hasattr(drafter, "observe_hidden")


def hidden_tap(model: Any, drafter: object) -> HiddenTap | None:
    """Return the model's tap when the drafter wants hidden states (binding the drafter to the model), else None.

    The drafter's `bind_model` may refuse the model (ModelError: not the one its dense part was built with).
    """
    return model_tap(model) if bind_drafter(model, drafter) else None


def bind_drafter(model: Any, drafter: object) -> bool:
    """Bind a drafter that queries with hidden states to the model (ModelError if refused); return whether it does."""
    if not wants_hidden(drafter):
        return False
    bind = getattr(drafter, "bind_model", None)
    if bind is not None:
        bind(model)
    return True


def model_tap(model: Any) -> HiddenTap:
    """Return the model's one tap, hooking the LM head on the first call (call it from the thread that runs it)."""
    tap = _TAPS.get(model)
    if tap is None:
        tap = _TAPS[model] = HiddenTap(model)
    return tap


def feed_hidden(drafter: object, context_length: int, hidden: np.ndarray | None) -> None:
    """Hand the drafter the hidden state that predicted the last of `context_length` tokens (None: unknown)."""
    observe = getattr(drafter, "observe_hidden", None)
    if observe is not None:
        observe(context_length, hidden)


@torch.no_grad()
def final_hidden(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Return the last hidden states [B, T, H] (the LM head's input) of token windows [B, T], without logits."""
    out = model.get_decoder()(input_ids=ids, use_cache=False)
    return out.last_hidden_state


def model_fingerprint(model: Any) -> str:
    """Return a short fingerprint of the model: its family, shape and a rounded sample of its head's weights."""
    config = model.config
    shape = [getattr(config, key, None) for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size")]
    digest = hashlib.sha256(repr(shape).encode())
    vocab = getattr(config, "vocab_size", None)
    with torch.no_grad():
        for weights in _embedding_weights(model):
            weights = weights[:vocab] if vocab else weights  # [V, H]: a head padded past the vocabulary (vLLM's)
            sample = weights[:: max(1, weights.shape[0] // 64)][:64].float()  # [64, H]: a strided sample of rows
            digest.update(torch.round(sample * 64).to(torch.int32).cpu().numpy().tobytes())  # tolerant of dtype
    return digest.hexdigest()[:16]


def _embedding_weights(model: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the LM head's and the input embedding's weights of a Hugging Face model or a vLLM one."""
    head = getattr(model, "lm_head", None)
    inner = getattr(getattr(model, "model", None), "embed_tokens", None)
    if head is not None and inner is not None and hasattr(head, "weight") and hasattr(inner, "weight"):
        return head.weight, inner.weight  # both kinds name them so (vLLM's get_input_embeddings wants token ids)
    return model.get_output_embeddings().weight, model.get_input_embeddings().weight
