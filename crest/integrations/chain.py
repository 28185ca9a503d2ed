"""The best chain of a draft tree: what an engine that verifies one path per row (vLLM) can check.

crest's drafters return trees; vLLM's rejection sampler verifies a chain of at most K tokens per row. The chain
worth verifying is the root-to-leaf path with the most expected accepted tokens: a chain of nodes c1..cd yields
sum_j P(c1..cj all right), the sum of the path probabilities of its nodes (`path_probabilities`), so the best
chain below a node is the node's own probability plus the best chain below one of its children.
"""

from __future__ import annotations

import numpy as np
from crest_client.draft import Draft, empty_draft, path_probabilities

from crest.decoding.tree import limit_depth


def best_chain(draft: Draft | None, *, depth: int) -> Draft:
    """Return the path of at most `depth` nodes with the most expected accepted tokens, as a chain-shaped draft.

    The chain keeps the tree's weights and root total, so its path probabilities are the tree's along that path.
    """
    if draft is None or len(draft) == 0 or depth <= 0:
        return empty_draft()
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
