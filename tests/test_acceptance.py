"""The acceptance scale and bands: how much of the verified drafts was accepted, overall and per prediction."""

from __future__ import annotations

import numpy as np
import pytest
from crest_client.draft import Draft

from crest.decoding.acceptance import BAND_DECAY, Acceptance, chain_hits


def _chain(probabilities: list[float]) -> Draft:
    """Return a chain whose path probabilities are `probabilities` (non-increasing, in (0, 1])."""
    weights = np.round(np.asarray(probabilities) * 1000).astype(np.int64)
    k = len(probabilities)
    return Draft(np.arange(k), np.arange(-1, k - 1, dtype=np.int32), weights, 4, 1000)


def test_the_scale_follows_the_last_steps_and_the_bands_each_prediction() -> None:
    """Sure nodes accepted as predicted, guesses at 0.3 accepted one time in twenty: the bands tell them apart,
    where the one ratio over both says neither."""
    rng = np.random.default_rng(0)
    acceptance = Acceptance()
    assert acceptance.scale == pytest.approx(0.5) and acceptance.bands() == []  # before any step
    for _ in range(300):
        probabilities = np.array([0.95] * 4 + [0.3] * 4)
        hits = np.concatenate([rng.random(4) < 0.95, rng.random(4) < 0.05])
        acceptance.observe(accepted=int(hits.sum()), predicted=float(probabilities.sum()),
                           probabilities=probabilities, hits=hits)  # fmt: skip
    bands = acceptance.bands()
    assert [round(p, 2) for p, _, _ in bands] == [0.3, 0.95]
    assert [a for _, a, _ in bands] == pytest.approx([0.05, 0.95], abs=0.03)
    assert [n for _, _, n in bands] == pytest.approx([4 / (1 - BAND_DECAY)] * 2, rel=0.06)  # decayed counts
    assert acceptance.scale == pytest.approx((0.95 * 4 + 0.05 * 4) / (0.95 * 4 + 0.3 * 4), abs=0.06)
    for _ in range(100):  # steps that say only their sums (a caller that cannot tell the nodes apart)
        acceptance.observe(accepted=1, predicted=10.0)
    assert acceptance.scale == pytest.approx(0.1, abs=0.01)  # the scale follows the last ~20 steps
    assert [a for _, a, _ in acceptance.bands()] == pytest.approx([0.05, 0.95], abs=0.03)  # no nodes: kept


@pytest.mark.parametrize("accepted", [0, 1, 3], ids=["none", "first", "whole"])
def test_chain_hits_mark_the_accepted_prefix(accepted: int) -> None:
    chains = [_chain([0.9, 0.6, 0.3]), _chain([0.5])]
    probabilities, hits = chain_hits(chains, [accepted, 1])
    assert probabilities == pytest.approx([0.9, 0.6, 0.3, 0.5])
    assert hits.tolist() == [i < accepted for i in range(3)] + [True]
    assert chain_hits([], [])[0].shape == (0,)
