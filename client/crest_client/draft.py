"""The draft token tree handed from a drafter to the verifier.

A `Draft` is a tree of candidate next tokens rooted at the last context token. Nodes are stored in an
order where every node's parent comes before it and weights never increase, so a prefix slice of the
node arrays is itself a valid (and, for stored trees, the best) subtree of that size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

_SMALL = 128  # nodes up to which a loop over Python lists beats numpy calls (each costs about a microsecond)


@dataclass(frozen=True, slots=True, eq=False)
class Draft:
    """A token tree: `tokens[i]` hangs under `parents[i]` (-1 = the root, the last context token)."""

    tokens: np.ndarray  # [T] int64 token ids
    parents: np.ndarray  # [T] int32, parents[i] < i, -1 = child of the root
    weights: np.ndarray  # [T] int64, continuations through the node, non-increasing
    n: int = 0  # length of the matched context suffix
    total: int = 0  # the root's weight, of which root children's weights are fractions; 0 = their sum
    # `path_probabilities`' answer, kept: a draft's arrays are never changed once made
    probabilities: np.ndarray | None = field(default=None, init=False, repr=False)

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def truncate(self, max_nodes: int) -> Draft:
        """Return the subtree made of the first `max_nodes` nodes (a prefix slice)."""
        if max_nodes >= len(self):
            return self
        k = max(0, int(max_nodes))
        cut = Draft(self.tokens[:k], self.parents[:k], self.weights[:k], self.n, self.total)
        if self.probabilities is not None:  # a prefix's nodes keep their path probabilities
            object.__setattr__(cut, "probabilities", self.probabilities[:k])
        return cut

    def depths(self) -> np.ndarray:
        """Return each node's depth: 1 for children of the root."""
        depth: list[int] = []  # Python ints: numpy's cost per element would dominate
        for p in self.parents.tolist():
            depth.append(1 if p < 0 else depth[p] + 1)
        return np.asarray(depth, dtype=np.int64)  # [T]

    def ancestor_mask(self) -> np.ndarray:
        """Return the tree attention mask: `mask[i, j]` is True when node j is node i or its ancestor."""
        size = len(self)
        mask = np.zeros((size, size), dtype=bool)  # [T, T]
        parents = self.parents.tolist()
        for i, p in enumerate(parents):
            if p >= 0:
                mask[i] = mask[p]
            mask[i, i] = True
        return mask

    def paths(self) -> list[list[int]]:
        """Return the token path from the root to each node."""
        out: list[list[int]] = []
        tokens = self.tokens.tolist()
        for i, p in enumerate(self.parents.tolist()):
            out.append((out[p] if p >= 0 else []) + [tokens[i]])
        return out

    def validate(self) -> None:
        """Raise ValueError unless the arrays form a well-ordered tree."""
        size = len(self)
        if self.parents.shape != (size,) or self.weights.shape != (size,):
            raise ValueError("draft arrays differ in length")
        if size <= _SMALL:  # a Python loop: numpy's cost per call dominates for a drafter's few dozen nodes
            for i, p in enumerate(self.parents.tolist()):
                if p >= i:
                    raise ValueError("a draft node comes before its parent")
                if p < -1:
                    raise ValueError("a draft node has a negative parent other than -1")
            return
        if np.any(self.parents >= np.arange(size)):
            raise ValueError("a draft node comes before its parent")
        if np.any(self.parents < -1):
            raise ValueError("a draft node has a negative parent other than -1")


def path_probabilities(draft: Draft) -> np.ndarray:
    """Return each node's estimated probability of being accepted: weight / parent-weight products, at most 1.

    A root child's share is its weight over `draft.total` when that is set and larger than the root children's sum.
    """
    if draft.probabilities is None:
        prob = _path_probabilities(draft)
        prob.flags.writeable = False  # shared by every caller
        object.__setattr__(draft, "probabilities", prob)
    return draft.probabilities  # type: ignore[return-value]


def with_chain_probabilities(draft: Draft) -> Draft:
    """Return the draft, its path probabilities kept, for a chain known to pass `chain_scale`'s checks.

    A chain cut from one that passed them passes them too (its weights still positive and never increasing, its
    total its consumed head's weight), so a proposer's stream skips the checks at every step.
    """
    if draft.probabilities is None and len(draft):
        prob = draft.weights / _head_weight(draft)  # `_path_probabilities`' division
        prob.flags.writeable = False
        object.__setattr__(draft, "probabilities", prob)
    return draft


def chain_scale(draft: Draft) -> float | None:
    """Return the number a chain's weights divide by to give its path probabilities, when they do (else None).

    Along a chain whose weights are positive and never increase, the products of weight ratios telescope: each
    node's path probability is its weight over the larger of the first weight and `draft.total`.
    """
    k = len(draft)
    parents = draft.parents
    if not k or int(parents[-1]) != k - 2 or parents.tolist() != list(range(-1, k - 1)):
        return None
    w = draft.weights.tolist()
    if w[-1] <= 0 or any(b > a for a, b in zip(w, w[1:], strict=False)):
        return None
    return _head_weight(draft)


def _head_weight(draft: Draft) -> float:
    """Return the weight a chain's path probabilities divide by: its first weight, or the root's total if larger."""
    return float(max(int(draft.weights[0]), int(draft.total)))


def shallow_probabilities(draft: Draft, depth: int) -> list[float]:
    """Return `path_probabilities` as a list, computing only the nodes within `depth` of the root (deeper: 0.0)."""
    if draft.probabilities is not None:
        return [p if d <= depth else 0.0 for p, d in zip(draft.probabilities.tolist(), _depths(draft), strict=True)]
    return _probabilities(draft, depth)


def _depths(draft: Draft) -> list[int]:
    depth: list[int] = []
    for p in draft.parents.tolist():
        depth.append(1 if p < 0 else depth[p] + 1)
    return depth


def _path_probabilities(draft: Draft) -> np.ndarray:
    scale = chain_scale(draft)  # a chain (the proposer's usual draft): one division
    if scale is not None:
        return draft.weights / scale
    return np.asarray(_probabilities(draft, len(draft)), dtype=np.float64)


def _probabilities(draft: Draft, depth: int) -> list[float]:
    """Return the path probabilities of the nodes within `depth` of the root, 0.0 for the deeper ones."""
    if depth <= 0:
        return [0.0] * len(draft)
    scale = chain_scale(draft)
    if scale is not None:  # a chain's node i is at depth i + 1
        return [x / scale if i < depth else 0.0 for i, x in enumerate(draft.weights.tolist())]
    # Python floats, a node at a time (parents before children): for trees of tens of nodes a loop over lists
    # costs a few microseconds, where each numpy call on so small an array costs about one
    w = [max(0.0, float(x)) for x in draft.weights.tolist()]
    parents = draft.parents.tolist()
    total = max(sum(x for x, p in zip(w, parents, strict=True) if p < 0), float(draft.total)) or 1.0
    prob = [0.0] * len(w)
    level = [0] * len(w)
    for i, p in enumerate(parents):
        if p < 0:
            prob[i], level[i] = w[i] / total, 1
        elif level[p] < depth:  # a child of a node above `depth`: within it
            prob[i] = prob[p] * (min(1.0, w[i] / w[p]) if w[p] > 0 else 0.0)
            level[i] = level[p] + 1
        else:
            level[i] = depth + 1  # below `depth`: left at 0.0, and so are its children
    return prob


def is_chain(draft: Draft) -> bool:
    """Return whether the draft is one path: every node the child of the node before it."""
    return bool(draft.parents.tolist() == list(range(-1, len(draft) - 1)))


def empty_draft(n: int = 0) -> Draft:
    """Return a draft with no nodes."""
    return Draft(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32), np.zeros(0, dtype=np.int64), n)
