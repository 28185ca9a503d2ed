"""Dense retrieval drafting (DReSD) and its hybrids: `dense`, `crest+dense` and `crest+dense+prompt`.

The query is the target's last hidden state at the position that predicted the context's last token (the generator,
or `crest serve`'s scheduler for each row of its batch, hands it over through `observe_hidden`: the last accepted
slot of the verify forward, so no extra forward; the scheduler's rows search through a `DenseLease`, one statement
for the batch). Its `k` nearest stored states each carry the tokens that followed them; the first of those is the
token their state predicted. As in DReSD, a neighbour counts only when that token is the one the target just
produced (the context's last token), and the rest of its continuation is its draft. The drafts form one trie
weighted by similarity (a node weighs the summed similarity of the neighbours through it), over the summed
similarity of all `k` neighbours, so a lookup where few neighbours agree with the target predicts few accepted
tokens. The hybrids merge that tree with the store's n-gram trees and the prompt's, each part scaled by how often
it proves right (`MergedDrafter`); every drafter here reports its part as "dense".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from crest_client.draft import Draft
from crest_client.order import order_small

import crest.drafters.dense_lease  # noqa: F401  (registers the part "dense_index" its kinds are built on)
from crest.decoding.drafter import Drafter
from crest.drafters.dense_index import NEIGHBOURS, DenseIndex, Neighbours
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from crest.drafters.registry import Kind, register
from crest.drafters.store import StoreDrafter

MAX_DRAFTS = 8  # of those agreeing with the target's token, the most similar kept
WEIGHT_SCALE = 1000  # integer weight of a neighbour of similarity 1


class DenseDrafter:
    """Drafts the continuations of the stored states nearest to the target's hidden state (not thread-safe)."""

    def __init__(self, index: DenseIndex, *, k: int = NEIGHBOURS, max_drafts: int = MAX_DRAFTS) -> None:
        self.index, self.k, self.max_drafts = index, k, max_drafts
        self._hidden: tuple[int, np.ndarray] | None = None  # (context length, hidden state [H])

    def bind_model(self, model: Any) -> None:
        """Check the querying model is the one the dense part was built with (ModelError if not)."""
        from crest.decoding.hidden import model_fingerprint

        self.index.check_model(model_fingerprint(model))

    def observe_hidden(self, context_length: int, hidden: np.ndarray | None) -> None:
        """Take the hidden state that predicted the last token of a context of this length (None: unknown)."""
        self._hidden = None if hidden is None else (context_length, np.asarray(hidden, dtype=np.float32))

    def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft | None:
        """Return the similarity-weighted trie of the agreeing neighbours' continuations, or None."""
        if max_nodes <= 0 or self._hidden is None or self._hidden[0] != len(context_ids) or not len(context_ids):
            return None
        found = self.index.search(self._hidden[1][None, :], k=self.k)[0]
        tree = neighbour_draft(found, int(context_ids[-1]), max_drafts=self.max_drafts, tree_size=max_nodes)
        return tree if tree is not None and len(tree) else None

    def drafted_parts(self, tree: Draft | None, *, context_length: int) -> dict[str, Draft]:
        """Return the one part behind this drafter's tree: the dense part."""
        return {"dense": tree} if tree is not None and len(tree) else {}


def neighbour_draft(
    found: Neighbours, token: int, *, max_drafts: int = MAX_DRAFTS, tree_size: int = 64
) -> Draft | None:
    """Return the trie of the continuations after `token` of the neighbours whose continuation starts with it.

    A node weighs the summed similarity of the neighbours through it (x WEIGHT_SCALE); the root total is that of
    every neighbour found, agreeing or not. None when no neighbour agrees.
    """
    weight_of = [max(1, round(WEIGHT_SCALE * max(sim, 0.0))) for _, sim in found]
    agreeing = [
        (cont[1:], w) for (cont, _), w in zip(found, weight_of, strict=True) if len(cont) > 1 and cont[0] == token
    ]
    if not agreeing:
        return None
    slot: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    tokens: list[int] = []
    parents: list[int] = []
    weights: list[int] = []
    for row, w in agreeing[:max_drafts]:
        up = -1
        for t in row:
            j = slot.setdefault((up, int(t)), len(tokens))
            if j == len(tokens):
                tokens.append(int(t))
                parents.append(up)
                weights.append(0)
            weights[j] += w
            up = j
    order = order_small(tokens, parents, weights)[:tree_size]
    position = {i: k for k, i in enumerate(order)}
    return Draft(
        np.array([tokens[i] for i in order], dtype=np.int64),
        np.array([position[parents[i]] if parents[i] >= 0 else -1 for i in order], dtype=np.int32),
        np.array([weights[i] for i in order], dtype=np.int64),
        0,
        int(sum(weight_of)),
    )


class HiddenMerged(MergedDrafter):
    """A merged drafter that hands the target's hidden states and model on to the parts that want them."""

    def bind_model(self, model: Any) -> None:
        """Bind both parts that query with hidden states to the model."""
        for part in (self.primary, self.secondary):
            bind = getattr(part, "bind_model", None)
            if bind is not None:
                bind(model)

    def observe_hidden(self, context_length: int, hidden: np.ndarray | None) -> None:
        """Hand the hidden state on to both parts that query with it."""
        for part in (self.primary, self.secondary):
            observe = getattr(part, "observe_hidden", None)
            if observe is not None:
                observe(context_length, hidden)


def _hybrid(parts: dict[str, Any], *, prompt: bool) -> Drafter:
    merged = HiddenMerged(StoreDrafter(parts["store"]), DenseDrafter(parts["dense_index"]))
    return HiddenMerged(merged, PromptDrafter()) if prompt else merged


# where the target's hidden states are handed over: a verify forward (generate, serve, bench generate), the
# replay's plain forward (bench accept), or the logits rows of vLLM's step (read from its model runner)
HIDDEN_PLACES = frozenset({"generate", "serve", "bench", "vllm"})

register(
    Kind(
        "dense",
        ("dense_index",),
        lambda parts: DenseDrafter(parts["dense_index"]),
        runs=HIDDEN_PLACES,
        summary="dense retrieval (DReSD): neighbours of the target's hidden state in the store's dense part",
    )
)
register(
    Kind(
        "crest+dense",
        ("store", "dense_index"),
        lambda parts: _hybrid(parts, prompt=False),
        runs=HIDDEN_PLACES,
        summary="the store's tree merged with its dense part's",
        fallback="crest",
    )
)
register(
    Kind(
        "crest+dense+prompt",
        ("store", "dense_index"),
        lambda parts: _hybrid(parts, prompt=True),
        runs=HIDDEN_PLACES,
        summary="the store's tree merged with its dense part's and prompt lookup",
        fallback="crest+prompt",
    )
)
