"""Tree-attention speculative generation that is exactly lossless, as a few small named steps.

Each step feeds the last accepted token (the root) and the whole draft tree, laid out breadth-first, to the
target model in one forward pass on top of its KV cache: a 4-D additive mask lets each node see the prefix
(within the sliding window, for models that have one), the root and its own ancestors only, and position ids
are the root's position plus the node's depth. The longest root-to-node path the target agrees with is
accepted, plus the target's own next token; the accepted path's KV entries are moved into place and the rest
dropped, with no recomputation. Greedy output equals plain greedy decoding; with sampling, each node's token
is drawn from the target's processed distribution and the walk follows the child that matches
(`crest.decoding.sampling`), so the output distribution is the target's own. What to draft and how much of it
to verify is `crest.decoding.policy`'s `DraftPolicy`, the policy every loop shares. A request is a `DecodeState`;
`generate` runs `start`, `prefill`, then `step` (`draft`, `verify`, `accept`, `commit`) until the state is done,
and `finish`; a scheduler can drive the same steps per row.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
from crest_client.draft import Draft, empty_draft

from crest.decoding.cache import compact_cache
from crest.decoding.drafter import Drafter, NoneDrafter
from crest.decoding.hidden import feed_hidden, hidden_tap
from crest.decoding.models import check_supported
from crest.decoding.policy import DraftPolicy, room_left
from crest.decoding.sampling import (
    accept_greedy,
    check_sampling,
    children_of,
    process_logits,
    sample_nodes,
)
from crest.decoding.sizing import CostModel, calibrate
from crest.decoding.text import TextTracker
from crest.decoding.tree import additive_mask, tree_inputs, tree_mask
from crest.errors import ConfigError, ModelError

log = logging.getLogger(__name__)


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


@dataclass
class DecodeState:
    """One request between steps: its context and output, KV cache, sampling options, counters and timers."""

    prompt: list[int]
    max_new_tokens: int
    text: TextTracker
    rng: torch.Generator
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    context: list[int] = field(default_factory=list)  # prompt + out: what the drafter sees
    out: list[int] = field(default_factory=list)
    cache: Any = None  # the target's KV cache of context[:-1]
    accepted_per_step: list[int] = field(default_factory=list)
    draft_tokens: int = 0
    started: float = 0.0  # perf_counter at prefill
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    seconds: float = 0.0  # prefill to done
    stop_reason: str | None = None  # None while running, then length | eos | stop | context
    tap: Any = None  # the model's HiddenTap when the drafter queries with hidden states, else None
    hidden: Any = None  # with a tap: the last hidden state [H] that predicted context[-1] (None: unknown)

    @property
    def done(self) -> bool:
        """Return whether the request has stopped."""
        return self.stop_reason is not None


def check_draft_tokens(max_draft_tokens: int | None) -> None:
    """Raise ConfigError unless the draft size is None (adaptive) or at least 0."""
    if max_draft_tokens is not None and max_draft_tokens < 0:
        raise ConfigError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")


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
        cost: CostModel | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> None:
        """Wrap a loaded model; `cost` is the forward cost model (None: calibrated when first needed).

        `on_progress` receives one line when that calibration has to measure (nothing is printed otherwise).
        """
        check_supported(model)
        check_draft_tokens(max_draft_tokens)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive and max_draft_tokens is None
        self.draft_budget = max_draft_tokens if max_draft_tokens is not None else draft_budget
        self.on_progress = on_progress
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.mask_dtype = self.dtype if self.dtype.is_floating_point else torch.float32
        config = model.config
        self.vocab = int(config.vocab_size)
        self.max_positions = int(getattr(config, "max_position_embeddings", None) or 1 << 30)
        self.eos_ids = eos_ids(model, tokenizer)
        self._windows = _mask_windows(config)
        self._cost = cost
        self.policy = DraftPolicy(budget=self.draft_budget, adaptive=self.adaptive, cost=self.cost, vocab=self.vocab)

    @property
    def acceptance_scale(self) -> float:
        """Return the observed ratio of accepted to weight-predicted draft nodes (0.5 before any step)."""
        return self.policy.acceptance_scale

    def cost(self) -> CostModel:
        """Return the forward cost model: the one passed in, else calibrated (cached per model, device, dtype)."""
        if self._cost is None:
            self._cost = calibrate(self.model, on_progress=self.on_progress)
        return self._cost

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
        state = self.start(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            stop=stop,
            on_text=on_text,
        )
        state.tap = hidden_tap(self.model, drafter)  # None unless the drafter queries with hidden states
        if self.adaptive and drafter is not None and not isinstance(drafter, NoneDrafter):
            self.cost()  # calibrate (or load the calibration) outside the timed generation
        self.prefill(state)
        while not state.done:
            self.step(state, drafter)
        return self.finish(state)

    def start(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
    ) -> DecodeState:
        """Check a request and return its state, before any forward."""
        prompt = [int(t) for t in prompt_ids]
        self._check_request(prompt, max_new_tokens)
        check_sampling(temperature=temperature, top_p=top_p, top_k=top_k)
        rng = torch.Generator(device=self.device)
        rng.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,)).item()))
        return DecodeState(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            text=TextTracker(self.tokenizer, stop=stop, on_text=on_text),
            rng=rng,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            context=list(prompt),
        )

    @torch.no_grad()
    def prefill(self, state: DecodeState) -> None:
        """Start the clock and fill a fresh KV cache with the prompt but its last token (the first root)."""
        from transformers import DynamicCache

        state.started = time.perf_counter()
        state.cache = DynamicCache()
        if len(state.prompt) > 1:
            ids = torch.tensor([state.prompt[:-1]], device=self.device)  # [1, P-1]
            self.model(ids, past_key_values=state.cache, use_cache=True)
            state.prefill_seconds = time.perf_counter() - state.started
            if state.tap is not None:
                state.hidden = state.tap.row(-1)

    def step(self, state: DecodeState, drafter: Drafter | None) -> None:
        """Run one decoding step: draft, verify root + tree in one forward, accept a path, commit it."""
        t0 = time.perf_counter()
        draft, predicted = self.draft(state, drafter)
        t1 = time.perf_counter()
        logits, kids = self.verify(state, draft)
        slots, new = self.accept(state, logits, kids)
        if state.tap is not None:  # the state at the last accepted slot predicted the token emitted after it
            state.hidden = state.tap.row(slots[-1] if slots else 0)
        state.draft_seconds += t1 - t0
        state.verify_seconds += time.perf_counter() - t1
        state.draft_tokens += len(draft)
        if len(draft):
            self.policy.observe(accepted=len(slots), predicted=predicted)
        self.commit(state, new, slots)

    def draft(self, state: DecodeState, drafter: Drafter | None) -> tuple[Draft, float]:
        """Return the draft to verify this step (cut to the room left and sized) and its expected accepted nodes."""
        if drafter is None or self.policy.skip(1):
            return empty_draft(), 0.0
        if state.tap is not None:
            feed_hidden(drafter, len(state.context), state.hidden)
        draft = self.policy.draft(drafter, state.context, room=self.room(state))
        sized, predicted = self.policy.size([draft])
        return sized[0], predicted

    def room(self, state: DecodeState) -> int:
        """Return the deepest draft path the request's next step may verify."""
        return room_left(
            context_length=len(state.context),
            generated=len(state.out),
            max_new_tokens=state.max_new_tokens,
            max_positions=self.max_positions,
        )

    @torch.no_grad()
    def verify(self, state: DecodeState, draft: Draft) -> tuple[torch.Tensor, list[dict[int, int]]]:
        """Return the target's logits [T+1, V] at the root and every node (one forward) and each slot's children."""
        past = len(state.context) - 1
        ids, pos, tokens, parent_slot = tree_inputs(state.context[-1], draft, past, device=self.device)
        logits = self._forward(ids, pos, self._masks(parent_slot, pos, past), state.cache)  # [T+1, V]
        return logits, children_of(parent_slot, tokens)

    def accept(
        self, state: DecodeState, logits: torch.Tensor, kids: list[dict[int, int]]
    ) -> tuple[list[int], list[int]]:
        """Return (accepted slots, emitted tokens): the target's pick at each node, walked from the root."""
        if state.temperature > 0:
            probs = process_logits(logits, temperature=state.temperature, top_k=state.top_k, top_p=state.top_p)
            picks = sample_nodes(probs, state.rng)  # one host sync per step
        else:
            picks = logits.argmax(dim=-1).tolist()  # one host sync per step
        return accept_greedy(picks, kids)

    def commit(self, state: DecodeState, new: list[int], slots: list[int]) -> None:
        """Append the emitted tokens up to eos, a stop string or a limit, stream the text, compact the cache."""
        past, before = len(state.context) - 1, len(state.out)
        new = new[: state.max_new_tokens - before]
        hit = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
        if hit is not None:
            new, state.stop_reason = new[: hit + 1], "eos"
        state.out.extend(new)
        end = state.text.stop_at(state.out, before)
        if end is not None:
            del state.out[end:]
            state.stop_reason = "stop"
        state.accepted_per_step.append(len(state.out) - before)
        state.context = state.prompt + state.out
        state.text.push(state.out)
        if state.stop_reason is None and len(state.out) >= state.max_new_tokens:
            state.stop_reason = "length"
        elif state.stop_reason is None and len(state.context) >= self.max_positions:
            state.stop_reason = "context"
        if state.done:
            state.seconds = time.perf_counter() - state.started
        else:
            compact_cache(state.cache, past, slots)

    def finish(self, state: DecodeState) -> GenerationResult:
        """Stream the rest of the text and return the request's output and figures."""
        state.text.push(state.out, final=True)
        out, seconds = state.out, state.seconds
        return GenerationResult(
            prompt_token_ids=state.prompt,
            output_token_ids=out,
            text=state.text.decode(out),
            new_tokens=len(out),
            forward_passes=len(state.accepted_per_step),
            mean_accepted_length=len(out) / max(1, len(state.accepted_per_step)),
            draft_seconds=state.draft_seconds,
            verify_seconds=state.verify_seconds + state.prefill_seconds,
            tokens_per_second=len(out) / seconds if seconds > 0 else 0.0,
            stop_reason=state.stop_reason or "length",
            draft_tokens=state.draft_tokens,
            accepted_per_step=state.accepted_per_step,
            seconds=seconds,
            prefill_seconds=state.prefill_seconds,
        )

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, masks: dict[str, torch.Tensor], cache: Any) -> Any:
        mask: Any = masks if len(masks) > 1 else next(iter(masks.values()))
        return self.model(ids, past_key_values=cache, attention_mask=mask, position_ids=pos, use_cache=True).logits[0]

    def _masks(self, parent_slot: np.ndarray, pos: torch.Tensor, past: int) -> dict[str, torch.Tensor]:
        """Return the additive tree mask for each attention type the model's layers use."""
        visible = tree_mask(parent_slot)
        return {
            kind: additive_mask(visible, pos, past, dtype=self.mask_dtype, window=window)
            for kind, window in self._windows.items()
        }

    def _check_request(self, prompt: list[int], max_new_tokens: int) -> None:
        if not prompt:
            raise ModelError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.vocab:
            raise ModelError(f"a prompt token id is outside the model's vocabulary of {self.vocab}")
        if len(prompt) >= self.max_positions:
            raise ModelError(f"the prompt has {len(prompt)} tokens; the model takes at most {self.max_positions}")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be positive, got {max_new_tokens}")


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
