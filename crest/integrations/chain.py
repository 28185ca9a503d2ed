"""The best chain of a draft tree: what an engine that verifies one path per row (vLLM) can check.

crest's drafters return trees; vLLM's rejection sampler verifies a chain of at most K tokens per row. The chain
worth verifying is the root-to-leaf path with the most expected accepted tokens: a chain of nodes c1..cd yields
sum_j P(c1..cj all right), the sum of the path probabilities of its nodes (`path_probabilities`), so the best
chain below a node is the node's own probability plus the best chain below one of its children.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from crest_client.draft import Draft, chain_scale, empty_draft, is_chain, path_probabilities, with_chain_probabilities

from crest.decoding.tree import limit_depth
from crest.learning.requests import path_length


def best_chain(draft: Draft | None, *, depth: int) -> Draft:
    """Return the path of at most `depth` nodes with the most expected accepted tokens, as a chain-shaped draft.

    The chain keeps the tree's weights and root total, so its path probabilities are the tree's along that path.
    """
    if draft is None or len(draft) == 0 or depth <= 0:
        return empty_draft()
    if is_chain(draft):  # its only path (the recent tier's usual answer)
        total = max(int(draft.weights[0]), int(draft.total))
        return Draft(draft.tokens[:depth], draft.parents[:depth], draft.weights[:depth], draft.n, total)
    tree = limit_depth(draft, depth)
    prob = path_probabilities(tree)  # [T]
    parents = tree.parents.tolist()
    best = prob.copy()  # [T] expected accepted tokens of the best chain starting at the node
    below = [-1] * len(parents)  # the child the best chain goes on with
    for i in range(len(parents) - 1, -1, -1):  # children come after their parents: theirs are final here
        if below[i] >= 0:
            best[i] = prob[i] + best[below[i]]
        p = parents[i]
        if p >= 0 and (below[p] < 0 or best[i] > best[below[p]]):
            below[p] = i
    roots = [i for i, p in enumerate(parents) if p < 0]
    path = [max(roots, key=lambda i: best[i])]
    while below[path[-1]] >= 0:
        path.append(below[path[-1]])
    at = np.asarray(path, dtype=np.int64)
    total = max(int(tree.weights[tree.parents < 0].sum()), int(tree.total))
    chain_parents = np.arange(-1, len(path) - 1, dtype=np.int32)
    return Draft(tree.tokens[at], chain_parents, tree.weights[at], tree.n, total)


def discount_tail(chain: Draft, *, sure: int, factor: float) -> Draft:
    """Return the chain with its path probabilities falling by `factor` per node past its first `sure` nodes.

    A tree's weights count how often each continuation followed the matched suffix, which says nothing of how
    far past the match the text keeps agreeing: a continuation seen once looks as sure at its tenth token as at
    its first. Weighed down past the match's depth, the tail is kept only where verifying it is nearly free.
    """
    k = len(chain)
    if k <= sure or factor >= 1.0:
        return chain
    weights = [w << _FINER for w in chain.weights.tolist()]  # integer weights: finer, so a small count can fall
    for j in range(max(0, sure), k):
        weights[j] = max(1, int(weights[j] * factor ** (j + 1 - sure)))
    total = max(int(chain.weights[0]), int(chain.total)) << _FINER  # the first weight may fall: keep the base
    return Draft(chain.tokens, chain.parents, np.asarray(weights, dtype=np.int64), chain.n, total)


_FINER = 10  # bits the weights of a discounted chain are shifted up by (the path probabilities are ratios)


def chain_parts(parts: dict[str, Draft], chain: Draft) -> dict[str, int]:
    """Return, per part, how many leading tokens of `chain` its tree holds as one path from its root."""
    tokens = chain.tokens.tolist()
    return {name: path_length(tree, tokens) for name, tree in parts.items()}


class ContextSource:
    """A row's own context as a stream's source: a chain copied from earlier in the context reads on there."""

    __slots__ = ("tokens",)

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens  # the row's token list, which grows as the target follows

    def tokens_from(self, position: int, length: int) -> list[int]:
        """Return up to `length` context tokens from `position` on."""
        return self.tokens[position : position + length] if position >= 0 and length > 0 else []


class ChainStream:
    """The rest of a row's last best chain: drafted again, with no lookup, while the target keeps following it.

    A chain is chosen from a tree as deep as the lookup allows (a deep match continues for dozens of tokens), but
    a step verifies at most K of them. When the step accepts the whole handed chain and its bonus token is the
    chain's next one, the target is still on that path, so the rest is the next step's chain: its nodes' path
    probabilities are conditioned on the consumed prefix (the total becomes the last consumed node's weight).
    `parts` says how many leading tokens each part's tree held, for the per-part accepted counts.
    A chain read from one earlier text (a deep match in the recent tier) also keeps where that text goes on: when
    fewer tokens are left than a step wants, the stream reads on in that text (`follow`), as deep as it started.
    The target followed every token so far, so the match is deeper than when it was found and earns the length.
    """

    __slots__ = ("at", "chain", "depth", "parts", "scaled", "source", "source_at", "source_part")

    def __init__(self) -> None:
        self.chain = empty_draft()
        self.at = -1  # the context length the chain continues
        self.parts: dict[str, int] = {}
        self.source: Any = None  # the text the chain was read from (`tokens_from(position, length)`), if one
        self.source_at = -1  # the position in it of the token after the chain's last
        self.source_part = ""  # the part the source's tokens count for
        self.depth = 0  # tokens the stream tops itself up to from its source
        self.scaled = False  # the chain passed `chain_scale`'s checks: so does what is left of it, step after step

    def start(
        self, chain: Draft, parts: dict[str, int], *, at: int, source: Any = None, source_at: int = -1,
        source_part: str = "recent",
    ) -> None:  # fmt: skip
        """Follow `chain`, drafted for a context of `at` tokens (its first tokens are handed out this step); with a
        `source` (of part `source_part`), read on in it from `source_at` once the chain runs short."""
        self.chain, self.parts, self.at = chain, parts, at
        self.source, self.source_at = (source, source_at) if source is not None and source_at >= 0 else (None, -1)
        self.source_part = source_part
        self.depth = len(chain)
        self.scaled = chain_scale(chain) is not None  # once per chain, not once per step
        if self.scaled:  # kept on the chain, and on every cut of it handed out
            with_chain_probabilities(chain)

    def clear(self) -> None:
        """Follow nothing (the target left the path)."""
        self.chain, self.parts, self.at, self.source, self.source_at = empty_draft(), {}, -1, None, -1
        self.scaled = False

    def advance(self, at: int, new: list[int]) -> None:
        """Step past the step's new tokens (accepted, then bonus), appended to a context of `at` tokens, when they
        are the stream's next ones; else follow nothing."""
        chain, used = self.chain, len(new)
        held = len(chain) if self.source is None else len(chain) + 1  # a source reads on after the chain's end
        if at != self.at or not used or held <= used or chain.tokens[:used].tolist() != new:
            self.clear()
            return
        total = int(chain.weights[used - 1])
        self.chain = Draft(chain.tokens[used:], chain.parents[: len(chain) - used], chain.weights[used:], chain.n,
                           total)  # fmt: skip
        if self.scaled:  # a proposer sizes every stream's chain every step: its probabilities are one division
            with_chain_probabilities(self.chain)
        self.parts = {name: depth - used for name, depth in self.parts.items() if depth > used}
        self.at = at + used

    def take(self, room: int, *, at: int) -> Draft | None:
        """Return the stream's next chain of `room` tokens for a context of `at` tokens, or None when it holds fewer
        (after reading on in its source) or follows another context (a lookup drafts then)."""
        if room <= 0 or at != self.at:
            return None
        if len(self.chain) <= room and self.source is not None:  # one more: the bonus token may follow it too
            self._read_on(max(room + 1, self.depth) - len(self.chain))
        if len(self.chain) < room:
            return None
        return self.chain.truncate(room)

    def _read_on(self, want: int) -> None:
        """Append up to `want` tokens of the source's text to the chain, each as sure as its last node."""
        more = self.source.tokens_from(self.source_at, want)
        if not more:
            self.source, self.source_at = None, -1  # the text ended or was evicted
            return
        chain, k = self.chain, len(self.chain)
        weight = int(chain.weights[-1]) if k else max(1, int(chain.total))
        self.chain = Draft(
            np.concatenate([chain.tokens, np.asarray(more, dtype=np.int64)]),
            np.arange(-1, k + len(more) - 1, dtype=np.int32),
            np.concatenate([chain.weights, np.full(len(more), weight, dtype=np.int64)]),
            chain.n + len(more),
            int(chain.total) or weight,
        )
        self.source_at += len(more)
        self.scaled = self.scaled or k == 0  # the appended weights repeat a positive last one
        if self.scaled:
            with_chain_probabilities(self.chain)
        self.parts[self.source_part] = self.parts.get(self.source_part, 0) + len(more)
