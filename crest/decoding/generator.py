"""Tree-attention speculative generation that is exactly lossless.

Each step feeds the last accepted token (the root) and the whole draft tree, laid out breadth-first, to the
target model in one forward pass on top of its KV cache: a 4-D additive mask lets each node see the prefix
(within the sliding window, for models that have one), the root and its own ancestors only, and position ids
are the root's position plus the node's depth. The longest root-to-node path the target agrees with is
accepted, plus the target's own next token; the accepted path's KV entries are moved into place and the rest
dropped, with no recomputation. Greedy output equals plain greedy decoding; with sampling, each node's token
is drawn from the target's processed distribution and the walk follows the child that matches
(`crest.sampling`), so the output distribution is the target's own. Draft sizes come from `crest.sizing`.

"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft

from crest.decoding.cache import compact_cache
from crest.decoding.models import check_supported
from crest.decoding.sampling import (
    accept_greedy,
    check_sampling,
    children_of,
    process_logits,
    sample_nodes,
)
from crest.decoding.sizing import CostModel, calibrate, choose_draft_size, path_probabilities
from crest.decoding.text import TextTracker
from crest.decoding.tree import additive_mask, check_draft, limit_depth, tree_inputs, tree_mask
from crest.drafters.protocol import Drafter
from crest.errors import ConfigError, ModelError

log = logging.getLogger(__name__)


EXPLORE_EVERY = 16  # steps without a worthwhile draft before one is verified anyway


EXPLORE_NODES = 4  # at most this many nodes in such a probe: enough to learn from, cheap to verify


@dataclass
class GenerationResult:
    """One generation's output and figures (M = mean_accepted_length, new tokens per target forward)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    new_tokens: int
    forward_passes: int
    mean_accepted_length: float
    draft_seconds: float
    verify_seconds: float
    tokens_per_second: float
    stop_reason: str  # length | eos | stop | context
    draft_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)
    seconds: float = 0.0
    prefill_seconds: float = 0.0

    @property
    def steps(self) -> int:
        """Return the number of decoding steps (one target forward each)."""
        return self.forward_passes

    def to_json(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict."""
        return asdict(self)


class SpeculativeGenerator:
    """Generates with a drafter and a Hugging Face causal LM, one target forward per step."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_draft_tokens: int | None = None,
        adaptive: bool = True,
        draft_budget: int = 64,
    ) -> None:
        check_supported(model)
        if max_draft_tokens is not None and max_draft_tokens < 0:
            raise ConfigError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive and max_draft_tokens is None
        self.draft_budget = max_draft_tokens if max_draft_tokens is not None else draft_budget
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.mask_dtype = self.dtype if self.dtype.is_floating_point else torch.float32
        config = model.config
        self.vocab = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
        self.eos_ids = eos_ids(model, tokenizer)
        self._windows = _mask_windows(config)
        self._cost: CostModel | None = None
        self._accepted, self._predicted = 0.0, 0.0  # decayed sums for the acceptance correction
        self._idle = 0  # steps since a draft was last verified
        self._failed_drafters: set[int] = set()

    @property
    def acceptance_scale(self) -> float:
        """Return the observed ratio of accepted to weight-predicted draft nodes (0.5 before any step)."""
        return float(np.clip((self._accepted + 0.5) / (self._predicted + 1.0), 0.05, 1.5))

    def cost(self) -> CostModel:
        """Return the measured forward cost model (calibrating once per model, device and dtype)."""
        if self._cost is None:
            self._cost = calibrate(self.model)
        return self._cost

    def _warn_once(self, drafter: Drafter, message: str) -> None:
        if id(drafter) not in self._failed_drafters:
            self._failed_drafters.add(id(drafter))
            log.warning("drafter %s: %s (no draft this step)", type(drafter).__name__, message)

    def _draft(self, drafter: Drafter | None, context: list[int], depth_room: int) -> tuple[Draft, float]:
        """Return the draft to verify this step and its weight-predicted accepted nodes."""
        if drafter is None or depth_room <= 0 or self.draft_budget <= 0:
            return _EMPTY, 0.0
        try:
            draft = drafter.draft(context, self.draft_budget)
            if draft is None or len(draft) == 0:
                return _EMPTY, 0.0
            check_draft(draft, self.vocab)
        except Exception as exc:  # a failing drafter costs a step's draft, never the generation
            self._warn_once(drafter, f"{type(exc).__name__}: {exc}")
            return _EMPTY, 0.0
        draft = limit_depth(draft.truncate(self.draft_budget), depth_room)
        size = len(draft)
        if self.adaptive:
            size = choose_draft_size(draft, self.cost(), acceptance_scale=self.acceptance_scale)
            self._idle = 0 if size else self._idle + 1
            if not size and (self._predicted < 2.0 or self._idle >= EXPLORE_EVERY):
                # without verified drafts the acceptance estimate cannot learn: now and then trust the weights
                trusted = choose_draft_size(draft, self.cost(), acceptance_scale=1.0)
                size, self._idle = max(1, min(trusted, EXPLORE_NODES)), 0
        predicted = float(path_probabilities(draft)[:size].sum())  # normalised over the whole draft
        return draft.truncate(size), predicted

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, masks: dict[str, torch.Tensor], cache: Any) -> Any:
        mask: Any = masks if len(masks) > 1 else next(iter(masks.values()))
        return self.model(ids, past_key_values=cache, attention_mask=mask, position_ids=pos, use_cache=True).logits[0]

    def _check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ModelError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ModelError(f"a prompt token id is outside the model's vocabulary of {self.vocab}")
        if len(prompt) >= self.max_positions:
            raise ModelError(f"the prompt has {len(prompt)} tokens; the model takes at most {self.max_positions}")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}")

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int],
        *,
        drafter: Drafter | None = None,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> GenerationResult:
        """Generate up to `max_new_tokens` after `prompt_ids`; greedy when temperature is 0."""
        from transformers import DynamicCache

        prompt = [int(t) for t in prompt_ids]
        self._check_request(prompt, max_new_tokens)
        check_sampling(temperature=temperature, top_p=top_p, top_k=top_k)
        sampling = temperature > 0
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        if self.adaptive and drafter is not None:
            self.cost()  # calibrate once, outside the timed generation
        text = TextTracker(self.tokenizer, stop=stop, on_text=on_text)
        out: list[int] = []
        accepted_steps: list[int] = []
        draft_s = verify_s = prefill_s = 0.0
        drafted = 0
        stop_reason = "length"
        start = time.perf_counter()
        cache = DynamicCache()
        if len(prompt) > 1:
            self.model(torch.tensor([prompt[:-1]], device=self.device), past_key_values=cache, use_cache=True)
            prefill_s = time.perf_counter() - start
        context = list(prompt)
        while True:
            past = len(context) - 1
            # a path of depth d needs positions up to past + d and emits d + 1 tokens
            room = min(self.max_positions - len(context) - 1, max_new_tokens - len(out) - 1)
            t0 = time.perf_counter()
            draft, predicted = self._draft(drafter, context, room)
            t1 = time.perf_counter()
            ids, pos, tokens, parent_slot = tree_inputs(context[-1], draft, past, device=self.device)
            masks = self._masks(parent_slot, pos, past)
            logits = self._forward(ids, pos, masks, cache)  # [T+1, V]
            kids = children_of(parent_slot, tokens)
            if sampling:
                probs = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p)
                picks = sample_nodes(probs, generator)  # one host sync per step
            else:
                picks = logits.argmax(dim=-1).tolist()  # one host sync per step
            slots, new = accept_greedy(picks, kids)
            draft_s += t1 - t0
            verify_s += time.perf_counter() - t1
            drafted += len(draft)
            if len(draft):
                self._accepted = 0.95 * self._accepted + len(slots)
                self._predicted = 0.95 * self._predicted + predicted
            before = len(out)
            new = new[: max_new_tokens - before]
            hit = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
            if hit is not None:
                new, stop_reason = new[: hit + 1], "eos"
            out.extend(new)
            end = text.stop_at(out, before)
            if end is not None:
                del out[end:]
                stop_reason = "stop"
            accepted_steps.append(len(out) - before)
            context = prompt + out
            text.push(out)
            if stop_reason != "length" or len(out) >= max_new_tokens:
                break
            if len(context) >= self.max_positions:
                stop_reason = "context"
                break
            compact_cache(cache, past, slots)
        seconds = time.perf_counter() - start
        text.push(out, final=True)
        steps = max(1, len(accepted_steps))
        return GenerationResult(
            prompt_token_ids=prompt,
            output_token_ids=out,
            text=text.decode(out),
            new_tokens=len(out),
            forward_passes=len(accepted_steps),
            mean_accepted_length=len(out) / steps,
            draft_seconds=draft_s,
            verify_seconds=verify_s + prefill_s,
            tokens_per_second=len(out) / seconds if seconds > 0 else 0.0,
            stop_reason=stop_reason,
            draft_tokens=drafted,
            accepted_per_step=accepted_steps,
            seconds=seconds,
            prefill_seconds=prefill_s,
        )

    def _masks(self, parent_slot: np.ndarray, pos: torch.Tensor, past: int) -> dict[str, torch.Tensor]:
        """Return the additive tree mask for each attention type the model's layers use."""
        visible = tree_mask(parent_slot)
        return {
            kind: additive_mask(visible, pos, past, dtype=self.mask_dtype, window=window)
            for kind, window in self._windows.items()
        }


def eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """Return the model's end-of-sequence ids (generation config first, else the tokenizer's)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _mask_windows(config: Any) -> dict[str, int | None]:
    """Return {attention type: sliding window or None}: one entry, or one per layer type when they differ."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or []
    if "sliding_attention" in layer_types and window:
        return {"full_attention": None, "sliding_attention": int(window)}
    if getattr(config, "model_type", None) == "mistral" and window:
        return {"full_attention": int(window)}
    return {"full_attention": None}


_EMPTY = Draft(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64), 0)
