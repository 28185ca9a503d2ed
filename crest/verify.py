"""Tree-attention speculative generation that is exactly lossless.

Each step feeds the last accepted token (the root) and the whole draft tree, laid out breadth-first, to the
target model in one forward pass on top of its KV cache: a 4-D mask lets each node see the prefix, the
root and its own ancestors only, and position ids are the root's position plus the node's depth. The
longest root-to-node path the target agrees with is accepted, plus the target's own next token; the KV
entries of the accepted path are moved into place and the rest dropped, with no recomputation. Greedy
output equals plain greedy decoding; with sampling, each node's token is sampled from the target's
(processed) distribution and the walk follows the child that matches, so the output distribution is the
target's own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from crest_client.draft import Draft

from crest.errors import ModelError

log = logging.getLogger(__name__)

SUPPORTED = ("llama", "qwen2", "mistral")  # tested: llama (SmolLM2, tiny), qwen2 (tiny)


class Drafter(Protocol):
    """Anything that proposes a draft tree for a context."""

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None: ...


@dataclass
class GenerationResult:
    """One generation's output and figures."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    new_tokens: int
    forward_passes: int
    mean_accepted_length: float
    draft_seconds: float
    verify_seconds: float
    tokens_per_second: float
    stop_reason: str
    draft_tokens: int = 0
    accepted_per_step: list[int] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Return the result as a JSON-ready dict."""
        return asdict(self)


def check_supported(model: Any) -> None:
    """Raise ModelError unless the model's family accepts a 4-D mask and position ids (tested families)."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in SUPPORTED:
        raise ModelError(
            f"model type {kind!r} is not supported by the tree verifier (supported: {', '.join(SUPPORTED)})"
        )


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
    """Return the [T+1, T+1] bool mask of root + nodes: each sees itself and its ancestors."""
    size = parent_slot.shape[0] + 1
    mask = np.zeros((size, size), dtype=bool)  # [T+1, T+1]
    mask[0, 0] = True
    for i, p in enumerate(parent_slot.tolist(), start=1):
        mask[i] = mask[p]
        mask[i, i] = True
    return mask


def build_tree_inputs(
    root: int, draft: Draft, past_len: int, *, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray, np.ndarray]:
    """Return (input_ids [1, T+1], position_ids [1, T+1], mask [1, 1, T+1, past+T+1], tokens, parent slots)."""
    order, parent_slot, depth = tree_layout(draft)
    tokens = np.concatenate(([root], draft.tokens[order])).astype(np.int64)
    positions = past_len + np.concatenate(([0], depth))
    visible = tree_mask(parent_slot)
    size = tokens.shape[0]
    mask = torch.zeros((1, 1, size, past_len + size), dtype=dtype)  # additive: 0 = attend
    mask[0, 0, :, past_len:] = torch.from_numpy(~visible).to(dtype) * torch.finfo(dtype).min
    ids = torch.from_numpy(tokens).view(1, -1).to(device)
    pos = torch.from_numpy(positions).view(1, -1).to(device)
    return ids, pos, mask.to(device), tokens, parent_slot


def children_of(parent_slot: np.ndarray, tokens: np.ndarray) -> list[dict[int, int]]:
    """Return, for each slot (root first), a map from child token to child slot."""
    kids: list[dict[int, int]] = [{} for _ in range(parent_slot.shape[0] + 1)]
    for slot, parent in enumerate(parent_slot.tolist(), start=1):
        kids[parent].setdefault(int(tokens[slot]), slot)
    return kids


def walk_tree(kids: list[dict[int, int]], pick: Callable[[int], int]) -> tuple[list[int], list[int]]:
    """Return (accepted slots, emitted tokens): from the root, take `pick(slot)` and follow a matching child."""
    slots: list[int] = []
    emitted: list[int] = []
    current = 0
    while True:
        token = pick(current)
        emitted.append(token)
        nxt = kids[current].get(token)
        if nxt is None:
            return slots, emitted
        slots.append(nxt)
        current = nxt


def accept_greedy(predicted: Sequence[int], kids: list[dict[int, int]]) -> tuple[list[int], list[int]]:
    """Return (accepted slots, emitted tokens): follow the target's argmax while a child matches."""
    return walk_tree(kids, lambda slot: int(predicted[slot]))


def process_logits(logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Return sampling probabilities [N, V] after temperature, top-k and top-p, as `generate` applies them."""
    scores = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, idx = torch.sort(scores, descending=False, dim=-1)
        cum = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cum <= (1 - top_p)
        remove[..., -1:] = False
        scores = scores.masked_fill(remove.scatter(-1, idx, remove), float("-inf"))
    return scores.softmax(dim=-1)


def accept_sampled(
    probs: torch.Tensor, kids: list[dict[int, int]], generator: torch.Generator
) -> tuple[list[int], list[int]]:
    """Return (accepted slots, emitted tokens): sample at each node, follow the child that matches."""
    return walk_tree(kids, lambda slot: int(torch.multinomial(probs[slot], 1, generator=generator).item()))


def compact_cache(cache: Any, past_len: int, slots: Sequence[int]) -> None:
    """Keep the prefix, the root and the accepted slots' KV entries (in path order); drop the rest."""
    keep = torch.tensor([past_len + s for s in slots], dtype=torch.long)
    for layer in cache.layers:
        device = layer.keys.device
        idx = torch.cat((torch.arange(past_len + 1, device=device), keep.to(device)))
        layer.keys = layer.keys.index_select(2, idx)
        layer.values = layer.values.index_select(2, idx)


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of every layer's keys and values."""
    for layer in cache.layers:
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


class CostModel:
    """Measured seconds of one forward of k tree tokens on top of a cache, for choosing the draft size."""

    def __init__(self, sizes: Sequence[int], seconds: Sequence[float]) -> None:
        self.sizes = np.asarray(sizes, dtype=np.float64)
        self.seconds = np.asarray(seconds, dtype=np.float64)

    def __call__(self, k: np.ndarray | int) -> np.ndarray:
        return np.interp(np.asarray(k, dtype=np.float64), self.sizes, self.seconds)


_COSTS: dict[tuple[int, str, str], CostModel] = {}


def calibrate(model: Any, *, sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64), context: int = 256) -> CostModel:
    """Measure (once per model, device and dtype) the forward time of k tokens after a cache of `context`."""
    param = next(model.parameters())
    ident = (id(model), str(param.device), str(param.dtype))
    if ident in _COSTS:
        return _COSTS[ident]
    from transformers import DynamicCache

    vocab = int(model.config.vocab_size)
    context = min(context, int(getattr(model.config, "max_position_embeddings", 2048)) - max(sizes) - 1)
    ids = torch.randint(0, vocab, (1, max(context, 1)), device=param.device)
    seconds = []
    with torch.no_grad():
        cache = DynamicCache()
        model(ids, past_key_values=cache, use_cache=True)
        for k in sizes:
            best = float("inf")
            for _ in range(3):
                step = torch.randint(0, vocab, (1, k), device=param.device)
                pos = torch.arange(ids.shape[1], ids.shape[1] + k, device=param.device).view(1, -1)
                t0 = time.perf_counter()
                model(step, past_key_values=cache, position_ids=pos, use_cache=True)
                if param.device.type == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
                crop_cache(cache, ids.shape[1])
            seconds.append(best)
    _COSTS[ident] = CostModel(sizes, seconds)
    return _COSTS[ident]


def choose_draft_size(draft: Draft, cost: CostModel, *, acceptance_scale: float = 1.0) -> int:
    """Return the prefix size k that maximises expected new tokens per second for this draft."""
    if len(draft) == 0:
        return 0
    total = float(draft.weights[draft.parents < 0].sum()) or 1.0
    gain = acceptance_scale * np.cumsum(draft.weights / total)  # expected accepted nodes of each prefix
    k = np.arange(1, len(draft) + 1)
    rate = (1.0 + gain) / cost(k + 1)
    base = 1.0 / float(cost(1))
    best = int(np.argmax(rate))
    return int(k[best]) if rate[best] > base else 0


class SpeculativeGenerator:
    """Generates with a drafter and a Hugging Face causal LM, one target forward per step."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        max_draft_tokens: int | None = None,
        adaptive: bool = True,
    ) -> None:
        check_supported(model)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_draft_tokens = max_draft_tokens
        self.adaptive = adaptive and max_draft_tokens is None
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_positions = int(getattr(model.config, "max_position_embeddings", 1 << 30))
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)
        self.eos_ids = set(eos if isinstance(eos, list) else ([eos] if eos is not None else []))
        self._cost: CostModel | None = None
        self._scale = 0.5  # running ratio of accepted to weight-predicted nodes
        self._failed_drafters: set[int] = set()

    def cost(self) -> CostModel:
        """Return the measured forward cost model (calibrating on first use)."""
        if self._cost is None:
            self._cost = calibrate(self.model)
        return self._cost

    def _draft(self, drafter: Drafter | None, context: list[int], room: int) -> Draft | None:
        if drafter is None or room <= 0:
            return None
        budget = min(self.max_draft_tokens or 64, room)
        try:
            draft = drafter.draft(context, budget)
        except Exception as exc:  # a failing drafter costs a step's draft, never the generation
            if id(drafter) not in self._failed_drafters:
                self._failed_drafters.add(id(drafter))
                log.warning("drafter %s failed (no draft this step): %s", type(drafter).__name__, exc)
            return None
        if draft is None or len(draft) == 0:
            return None
        draft = draft.truncate(budget)
        if self.adaptive:
            draft = draft.truncate(choose_draft_size(draft, self.cost(), acceptance_scale=self._scale))
        return draft if len(draft) else None

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
        if not prompt:
            raise ModelError("the prompt has no tokens")
        if len(prompt) >= self.max_positions:
            raise ModelError(f"the prompt has {len(prompt)} tokens; the model takes at most {self.max_positions}")
        sampling = temperature > 0
        generator = torch.Generator(device="cpu")
        generator.manual_seed(seed if seed is not None else 0)
        out: list[int] = []
        accepted_steps: list[int] = []
        draft_s = verify_s = 0.0
        drafted = 0
        stop_reason = "length"
        if self.adaptive and drafter is not None:
            self.cost()  # calibrate once, outside the timed generation
        start = time.perf_counter()
        cache = DynamicCache()
        if len(prompt) > 1:
            t0 = time.perf_counter()
            self.model(torch.tensor([prompt[:-1]], device=self.device), past_key_values=cache, use_cache=True)
            verify_s += time.perf_counter() - t0
        context = list(prompt)
        emitted_text = ""
        while len(out) < max_new_tokens:
            past = len(context) - 1
            room = min(self.max_positions - len(context) - 1, max_new_tokens - len(out) - 1)
            t0 = time.perf_counter()
            draft = self._draft(drafter, context, room) or _EMPTY
            draft_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            ids, pos, mask, tokens, parent_slot = build_tree_inputs(
                context[-1], draft, past, device=self.device, dtype=self.dtype
            )
            logits = self.model(
                ids, past_key_values=cache, attention_mask=mask, position_ids=pos, use_cache=True
            ).logits[0]  # [T+1, V]
            kids = children_of(parent_slot, tokens)
            if sampling:
                probs = process_logits(logits, temperature=temperature, top_k=top_k, top_p=top_p).cpu()
                slots, new = accept_sampled(probs, kids, generator)
            else:
                slots, new = accept_greedy(logits.argmax(dim=-1).tolist(), kids)  # one host sync per step
            verify_s += time.perf_counter() - t0
            drafted += len(draft)
            if len(draft):
                predicted = float(draft.weights[: len(draft)].sum() / max(1, draft.weights[draft.parents < 0].sum()))
                self._scale = 0.9 * self._scale + 0.1 * min(1.0, len(slots) / max(predicted, 1e-6))
            new = new[: max_new_tokens - len(out)]
            hit = next((i for i, t in enumerate(new) if t in self.eos_ids), None)
            if hit is not None:
                new = new[: hit + 1]
            out.extend(new)
            accepted_steps.append(len(new))
            context.extend(new)
            if on_text is not None or stop:
                text = self.tokenizer.decode(out, skip_special_tokens=True)
                if on_text is not None and len(text) > len(emitted_text):
                    on_text(text[len(emitted_text) :])
                emitted_text = text
                if stop and any(s in text for s in stop):
                    stop_reason = "stop"
                    break
            if hit is not None:
                stop_reason = "eos"
                break
            if len(out) >= max_new_tokens:
                break
            if len(context) >= self.max_positions:
                stop_reason = "context"
                break
            compact_cache(cache, past, slots)
        seconds = time.perf_counter() - start
        steps = max(1, len(accepted_steps))
        return GenerationResult(
            prompt_token_ids=prompt,
            output_token_ids=out,
            text=self.tokenizer.decode(out, skip_special_tokens=True),
            new_tokens=len(out),
            forward_passes=len(accepted_steps),
            mean_accepted_length=len(out) / steps,
            draft_seconds=draft_s,
            verify_seconds=verify_s,
            tokens_per_second=len(out) / seconds if seconds > 0 else 0.0,
            stop_reason=stop_reason,
            draft_tokens=drafted,
            accepted_per_step=accepted_steps,
        )


def generate_plain(
    model: Any, tokenizer: Any, prompt_ids: Sequence[int], *, max_new_tokens: int = 128
) -> GenerationResult:
    """Run `model.generate` greedily (the baseline) and return its result with timings."""
    ids = torch.tensor([list(prompt_ids)], device=next(model.parameters()).device)
    start = time.perf_counter()
    with torch.no_grad():
        full = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=getattr(tokenizer, "eos_token_id", None),
        )
    seconds = time.perf_counter() - start
    out = full[0, ids.shape[1] :].tolist()
    return GenerationResult(
        prompt_token_ids=list(prompt_ids),
        output_token_ids=out,
        text=tokenizer.decode(out, skip_special_tokens=True),
        new_tokens=len(out),
        forward_passes=len(out),
        mean_accepted_length=1.0,
        draft_seconds=0.0,
        verify_seconds=seconds,
        tokens_per_second=len(out) / seconds if seconds else 0.0,
        stop_reason="generate",
    )


_EMPTY = Draft(np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.int64), 0)
