"""How often the target accepts draft nodes: the policy's acceptance scale, and the same per band of prediction.

The drafting policy values a draft node at its path probability times one ratio, learned over the last ~20 verified
steps: accepted over predicted nodes (`Acceptance.scale`). That ratio is the level: at one row, a request on a run
of copies accepts more than the average at the same prediction, and the ratio follows it. How the ratio is made of
sure nodes and guesses is kept too: decayed counts of verified and accepted nodes per band of predicted probability
(`EDGES`), which the vLLM proposer's INFO line says (`bands`). They show where the predictions fail: on chat at
first sight nodes predicted at 0.3 were accepted 13% of the time, and chains predicted sure (a stream's, a prompt
copy's) 62-98%.

Sizing by the bands instead (each node valued at its band's acceptance, the curve pooled to never fall, its level
set by the ratio) was tried and measured (docs/vllm.md, "Acceptance by band"): on chat it verified 23% fewer tokens
for 11% fewer accepted, and it made 1-3% fewer tokens/s in `crest bench proposer`'s CPU-shaped first sight on chat,
HumanEval and code edits; the one ratio stays.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from crest_client.draft import Draft, path_probabilities

EDGES = np.array([0.0, 0.05, 0.1, 0.2, 0.35, 0.5, 0.7, 0.85, 0.95, 1.0])  # bands of predicted path probability

DECAY = 0.95  # per verified step: the scale follows the last ~20 steps

BAND_DECAY = 0.99  # per verified step: a band's counts follow the last ~100 steps (a step's nodes spread over bands)

SCALE_BOUNDS = (0.05, 1.5)  # clip of the scale


class Acceptance:
    """Decayed counts of predicted and accepted draft nodes: the policy's scale, and the same per band."""

    def __init__(self) -> None:
        self._accepted, self._predicted = 0.0, 0.0  # decayed sums over all verified steps
        bands = len(EDGES) - 1
        self._nodes = np.zeros(bands)  # [bands] decayed verified nodes
        self._hits = np.zeros(bands)  # [bands] decayed accepted nodes
        self._sums = np.zeros(bands)  # [bands] decayed sum of their predictions

    @property
    def scale(self) -> float:
        """Return the observed ratio of accepted to predicted draft nodes over the last steps (0.5 before any)."""
        low, high = SCALE_BOUNDS  # Python floats: read every step
        return min(high, max(low, (self._accepted + 0.5) / (self._predicted + 1.0)))

    @property
    def evidence(self) -> float:
        """Return the decayed number of predicted nodes verified so far (below 2: still exploring)."""
        return self._predicted

    def observe(
        self, *, accepted: float, predicted: float, probabilities: np.ndarray | None = None,
        hits: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        """Fold one verified step in: its accepted and predicted nodes, and each verified node's prediction and
        whether it was accepted (`probabilities`, `hits`: [N], when the caller knows them)."""
        self._accepted = DECAY * self._accepted + accepted
        self._predicted = DECAY * self._predicted + predicted
        if probabilities is not None and hits is not None and len(probabilities):
            band = np.searchsorted(EDGES[1:-1], probabilities, side="right")  # [N] in 0 .. bands-1
            bands = len(self._nodes)
            self._nodes = BAND_DECAY * self._nodes + np.bincount(band, minlength=bands)
            self._hits = BAND_DECAY * self._hits + np.bincount(band, weights=hits.astype(np.float64), minlength=bands)
            self._sums = BAND_DECAY * self._sums + np.bincount(band, weights=probabilities, minlength=bands)

    def bands(self) -> list[tuple[float, float, float]]:
        """Return (mean prediction, share accepted, decayed nodes) of each band that has seen a node."""
        seen = self._nodes > 0
        means = self._sums[seen] / self._nodes[seen]
        return list(zip(means.tolist(), (self._hits[seen] / self._nodes[seen]).tolist(), self._nodes[seen].tolist(),
                        strict=True))  # fmt: skip


def chain_hits(chains: Sequence[Draft], accepted: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Return the verified chains' node predictions and whether each was accepted ([N] each; a chain's first
    `accepted` nodes were)."""
    if not chains:
        return np.zeros(0), np.zeros(0, dtype=bool)
    probabilities = np.concatenate([path_probabilities(c) for c in chains])
    hits = np.concatenate([np.arange(len(c)) < a for c, a in zip(chains, accepted, strict=True)])
    return probabilities, hits
