"""Draft sizing: acceptance estimates from weights, the measured cost curve, and the size that maximises
expected tokens per second."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from crest_client.draft import Draft
from hypothesis import given, settings
from hypothesis import strategies as st

from crest.decoding.generator import SpeculativeGenerator
from tests.fix_models import IdTokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("torch_threads")  # one torch thread per test, restored after


def test_path_probabilities_are_weight_ratio_products() -> None:
    from crest_client.draft import path_probabilities

    draft = Draft(np.array([1, 2, 3, 4, 5]), np.array([-1, -1, 0, 2, 1], dtype=np.int32), np.array([6, 2, 3, 3, 4]))
    # root children 6/8 and 2/8; 3 of 6 go on; all 3 of those go on; a child heavier than its parent is capped
    np.testing.assert_allclose(path_probabilities(draft), [0.75, 0.25, 0.375, 0.375, 0.25])
    # a root weight larger than the children's sum makes them fractions of it; a smaller one is ignored
    np.testing.assert_allclose(path_probabilities(replace(draft, total=16)), [0.375, 0.125, 0.1875, 0.1875, 0.125])
    np.testing.assert_allclose(path_probabilities(replace(draft, total=4)), [0.75, 0.25, 0.375, 0.375, 0.25])
    np.testing.assert_allclose(path_probabilities(replace(draft, total=16).truncate(3)), [0.375, 0.125, 0.1875])


@settings(max_examples=200, deadline=None)
@given(
    parents=st.lists(st.integers(-1, 30), min_size=1, max_size=24),
    weights=st.lists(st.integers(0, 50), min_size=24, max_size=24),
    depth=st.integers(0, 6),
    total=st.sampled_from([0, 7, 1000]),
    cached=st.booleans(),
    chain=st.booleans(),
)
def test_shallow_probabilities_are_the_path_probabilities_within_the_depth(
    parents: list[int], weights: list[int], depth: int, total: int, cached: bool, chain: bool
) -> None:
    """`shallow_probabilities` gives every node within `depth` of the root its path probability, bit for bit (a tree
    or a chain, cached or not), and the deeper ones 0.0."""
    from crest_client.draft import chain_scale, path_probabilities, shallow_probabilities

    up = [min(p, i - 1) for i, p in enumerate(parents)]  # parents before children
    w = weights[: len(up)]
    if chain:  # a falling chain: the one-division rule
        up, w = list(range(-1, len(up) - 1)), sorted((x + 1 for x in w), reverse=True)
    draft = Draft(np.arange(len(up)), np.array(up, dtype=np.int32), np.array(w), 0, total)
    assert not chain or chain_scale(draft) is not None
    fresh = Draft(draft.tokens, draft.parents, draft.weights, 0, total)
    want = path_probabilities(draft).tolist()
    got = shallow_probabilities(draft if cached else fresh, depth)
    for p, w, d in zip(got, want, draft.depths().tolist(), strict=True):
        assert p == (w if d <= depth else 0.0)


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
    from crest.decoding.policy import choose_draft_size
    from crest.decoding.sizing import CostModel

    chain_weights = np.array([90, 80, 50, 20, 10, 9])
    draft = Draft(np.arange(6), np.arange(-1, 5, dtype=np.int32), chain_weights)
    assert choose_draft_size(draft, CostModel([1, 2, 4, 8], seconds), acceptance_scale=scale) == want


def test_cost_model_is_monotone_and_extrapolates() -> None:
    from crest.decoding.sizing import CostModel

    cost = CostModel([1, 2, 4], [1.3, 0.9, 2.0])  # the slow k = 1 was noise: it costs at most what k = 2 does
    np.testing.assert_allclose(cost(np.array([1, 2, 3, 4, 6])), [0.9, 0.9, 1.45, 2.0, 3.1])


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A CREST_HOME of this test's own, so calibrations cached by other tests are not found."""
    monkeypatch.setenv("CREST_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Count calls of the timing function (the real one still runs): one entry, the dtype, per measurement."""
    from crest.decoding import sizing

    calls: list[str] = []
    real = sizing.measure_costs

    def spy(model: Any, **options: Any) -> sizing.CostModel:
        calls.append(str(next(model.parameters()).dtype))
        return real(model, **options)

    monkeypatch.setattr(sizing, "measure_costs", spy)
    return calls


def calibrate_small(model: Any) -> Any:
    """Calibrate over three sizes in one round (fast on tiny models)."""
    from crest.decoding.sizing import calibrate

    return calibrate(model, sizes=(1, 4, 16), repeats=1)


def test_calibration_is_measured_once_per_model_in_a_process(home: Path, measured: list[str]) -> None:
    from crest.decoding.sizing import calibrate

    model = tiny_model("llama", max_positions=64)
    first = calibrate_small(model)
    assert calibrate_small(model) is first and len(measured) == 1
    assert first.sizes.tolist() == [1.0, 4.0, 16.0] and (first.seconds > 0).all()
    gen = SpeculativeGenerator(model, IdTokenizer())
    assert gen.adaptive and gen.cost() is calibrate(model)


def test_a_second_generator_loads_the_cached_calibration(home: Path, measured: list[str]) -> None:
    """A new process (here: a new model object of the same checkpoint) reads CREST_HOME instead of measuring."""
    from crest.decoding.sizing import CostModel

    lines: list[str] = []
    first = SpeculativeGenerator(tiny_model("llama", seed=1), IdTokenizer(), on_progress=lines.append).cost()
    assert measured == ["torch.float32"]
    assert lines[0].startswith("calibrating the draft cost model for llama on cpu/float32")
    rounds = [line.split(" done")[0] for line in lines[1:]]  # progress after each round: never silent for minutes
    assert rounds == [f"calibrating: round {i} of 3" for i in (1, 2, 3)], lines
    [cached] = (home / "calibration").glob("*.json")
    assert not list((home / "calibration").glob("*.tmp"))  # written through a temporary file, renamed
    again = SpeculativeGenerator(tiny_model("llama", seed=1), IdTokenizer(), on_progress=lines.append).cost()
    assert measured == ["torch.float32"] and len(lines) == 4  # loaded: no timing, no progress line
    np.testing.assert_array_equal(again.seconds, first.seconds)
    given = CostModel([1, 2], [1.0, 2.0])
    assert SpeculativeGenerator(tiny_model("llama"), IdTokenizer(), cost=given).cost() is given
    cached.write_text("{not json")
    SpeculativeGenerator(tiny_model("llama", seed=1), IdTokenizer()).cost()
    assert len(measured) == 2 and json.loads(cached.read_text())["key"]["dtype"] == "float32"  # measured, rewritten


def test_no_calibration_when_nothing_is_drafted_or_the_size_is_fixed(home: Path, measured: list[str]) -> None:
    from crest.decoding.drafter import NoneDrafter

    model = tiny_model("llama")
    SpeculativeGenerator(model, IdTokenizer()).generate([1, 2], max_new_tokens=3)
    SpeculativeGenerator(model, IdTokenizer()).generate([1, 2], drafter=NoneDrafter(), max_new_tokens=3)
    SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=4).generate([1, 2], drafter=NoneDrafter())
    assert measured == []

    class Chain:
        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft:
            return Draft(np.array([3, 4]), np.array([-1, 0], dtype=np.int32), np.array([2, 1]))

    SpeculativeGenerator(model, IdTokenizer()).generate([1, 2], drafter=Chain(), max_new_tokens=3)
    assert measured == ["torch.float32"]  # a drafter that drafts: calibrated before the timed generation


@pytest.mark.parametrize("change", ["dtype", "threads", "config"], ids=["dtype", "threads", "config"])
def test_a_changed_dtype_thread_count_or_model_invalidates_the_cache(
    home: Path, measured: list[str], change: str
) -> None:
    calibrate_small(tiny_model("llama"))
    assert len(measured) == 1
    if change == "dtype":
        calibrate_small(tiny_model("llama", dtype=torch.bfloat16))
    elif change == "threads":
        torch.set_num_threads(2)  # the torch_threads fixture restores the count
        calibrate_small(tiny_model("llama"))
    else:
        calibrate_small(tiny_model("llama", hidden=48))
    assert len(measured) == 2
    assert len(list((home / "calibration").glob("*.json"))) == 2
    calibrate_small(tiny_model("llama"))  # the first key is still cached beside the new one
    assert len(measured) == 2


def test_an_unwritable_home_only_costs_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, measured: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("CREST_HOME", str(tmp_path / "file"))  # a file: no directory can be made under it
    with caplog.at_level(logging.WARNING, logger="crest.decoding.sizing"):
        cost = calibrate_small(tiny_model("llama"))
    assert (cost.seconds > 0).all() and len(measured) == 1
    assert any("cannot cache the draft cost model" in r.getMessage() for r in caplog.records)


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

    cost = CostModel([1, 2, 4, 8], [1.0, 1.45, 1.8, 2.4])  # at the prior 0.5 no draft pays
    gen = SpeculativeGenerator(model, IdTokenizer(), cost=cost)
    got = gen.generate(prompt, drafter=Humble(), max_new_tokens=80)
    assert got.output_token_ids == want
    assert got.forward_passes < 0.5 * got.new_tokens, got.accepted_per_step
    assert gen.acceptance_scale > 1.0
