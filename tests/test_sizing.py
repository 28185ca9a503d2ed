"""Draft sizing: acceptance estimates from weights, the measured cost curve, and the size that maximises
expected tokens per second."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np
import pytest
import torch
from crest_client.draft import Draft

from crest.decoding.generator import SpeculativeGenerator
from tests.fix_models import IdTokenizer, tiny_model

torch.set_num_threads(1)


def test_path_probabilities_are_weight_ratio_products() -> None:
    from crest.decoding.sizing import path_probabilities

    draft = Draft(np.array([1, 2, 3, 4, 5]), np.array([-1, -1, 0, 2, 1], dtype=np.int32), np.array([6, 2, 3, 3, 4]))
    # root children 6/8 and 2/8; 3 of 6 go on; all 3 of those go on; a child heavier than its parent is capped
    np.testing.assert_allclose(path_probabilities(draft), [0.75, 0.25, 0.375, 0.375, 0.25])
    # a root weight larger than the children's sum makes them fractions of it; a smaller one is ignored
    np.testing.assert_allclose(path_probabilities(replace(draft, total=16)), [0.375, 0.125, 0.1875, 0.1875, 0.125])
    np.testing.assert_allclose(path_probabilities(replace(draft, total=4)), [0.75, 0.25, 0.375, 0.375, 0.25])
    np.testing.assert_allclose(path_probabilities(replace(draft, total=16).truncate(3)), [0.375, 0.125, 0.1875])


@pytest.mark.parametrize(
    ("seconds", "scale", "want"),
    [
        ([1.0, 1.0, 1.0, 1.0], 1.0, 6),  # a GPU: extra tokens are free, take the whole tree
        ([1.0, 1.8, 3.6, 7.2], 1.0, 1),  # a slow CPU: each token costs nearly a forward, keep the best node
        ([1.0, 1.1, 1.3, 1.7], 1.0, 3),  # in between
        ([1.0, 2.0, 4.0, 8.0], 0.01, 0),  # drafts that are never accepted are not worth a token
    ],
    ids=["flat", "linear", "mild", "hopeless"],
)
def test_choose_draft_size_trades_acceptance_for_cost(seconds: list[float], scale: float, want: int) -> None:
    from crest.decoding.sizing import CostModel, choose_draft_size

    chain_weights = np.array([90, 80, 50, 20, 10, 9])
    draft = Draft(np.arange(6), np.arange(-1, 5, dtype=np.int32), chain_weights)
    assert choose_draft_size(draft, CostModel([1, 2, 4, 8], seconds), acceptance_scale=scale) == want


def test_cost_model_is_monotone_and_extrapolates() -> None:
    from crest.decoding.sizing import CostModel

    cost = CostModel([1, 2, 4], [1.3, 0.9, 2.0])  # the slow k = 1 was noise: it costs at most what k = 2 does
    np.testing.assert_allclose(cost(np.array([1, 2, 3, 4, 6])), [0.9, 0.9, 1.45, 2.0, 3.1])


def test_calibration_is_cached_per_model_device_and_dtype() -> None:
    from crest.decoding.sizing import calibrate

    model = tiny_model("llama", max_positions=64)
    first = calibrate(model, sizes=(1, 4, 16), repeats=1)
    assert calibrate(model, sizes=(1, 4, 16), repeats=1) is first
    assert first.sizes.tolist() == [1.0, 4.0, 16.0] and (first.seconds > 0).all()
    assert calibrate(model.double(), sizes=(1, 4), repeats=1) is not first
    gen = SpeculativeGenerator(model, IdTokenizer())
    assert gen.adaptive and gen.cost() is calibrate(model)


def test_sizing_learns_that_underweighted_drafts_pay_off() -> None:
    """Weights that promise little keep drafts out at first; verified now and then, they prove better."""
    from crest.decoding.sizing import CostModel

    model = tiny_model("llama", seed=1)
    model.generation_config.eos_token_id = None
    prompt = [4, 8, 15]
    with torch.no_grad():
        full = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=80, pad_token_id=0)
    want = full[0, 3:].tolist()

    class Humble:
        """The true continuation beside an equally weighted wrong sibling, weights halving along the path."""

        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft:
            done = len(context_ids) - len(prompt)
            truth = want[done : done + 6]
            tokens = [truth[0], (truth[0] + 1) % 64, *truth[1:]]
            parents = [-1, -1, *[0, *range(2, len(truth))][: len(truth) - 1]]
            weights = [10, 10, *[max(1, 10 >> i) for i in range(1, len(truth))]]
            return Draft(np.array(tokens), np.array(parents, dtype=np.int32), np.array(weights))

    gen = SpeculativeGenerator(model, IdTokenizer())
    gen._cost = CostModel([1, 2, 4, 8], [1.0, 1.45, 1.8, 2.4])  # at the prior 0.5 no draft pays
    got = gen.generate(prompt, drafter=Humble(), max_new_tokens=80)
    assert got.output_token_ids == want
    assert got.forward_passes < 0.5 * got.new_tokens, got.accepted_per_step
    assert gen.acceptance_scale > 1.0
