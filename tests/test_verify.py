"""The verifier against plain greedy decoding on tiny random models, and its small pure helpers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from crest_client.draft import Draft
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from crest.errors import ModelError
from crest.verify import SpeculativeGenerator, accept_greedy, children_of, tree_layout, tree_mask
from tests.fix_models import IdTokenizer, tiny_model

torch.set_num_threads(1)


def plain_greedy(model: object, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        full = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new, pad_token_id=0
        )  # type: ignore[attr-defined]
    return full[0, len(prompt) :].tolist()


class OracleDrafter:
    """Drafts the true continuation (from a reference run) with random wrong branches and random cuts."""

    def __init__(self, reference: list[int], prompt_len: int, rng: np.random.Generator, vocab: int) -> None:
        self.reference, self.prompt_len, self.rng, self.vocab = reference, prompt_len, rng, vocab

    def draft(self, context: list[int], max_nodes: int) -> Draft | None:
        done = len(context) - self.prompt_len
        if self.rng.random() < 0.15:
            return None
        truth = self.reference[done : done + int(self.rng.integers(0, 8))]
        if self.rng.random() < 0.3 and truth:
            truth = truth[:-1] + [int(self.rng.integers(0, self.vocab))]  # a wrong last token
        tokens, parents = [], []
        for i, t in enumerate(truth):
            tokens.append(t)
            parents.append(i - 1 if i else -1)
        for _ in range(int(self.rng.integers(0, 6))):  # noise branches anywhere
            tokens.append(int(self.rng.integers(0, self.vocab)))
            parents.append(int(self.rng.integers(-1, len(tokens) - 1)))
        if not tokens:
            return None
        weights = np.arange(len(tokens), 0, -1)
        return Draft(np.array(tokens), np.array(parents, dtype=np.int32), weights, 1).truncate(max_nodes)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(["llama", "qwen2"]),
    st.integers(0, 10_000),
    st.lists(st.integers(0, 62), min_size=1, max_size=12),
    st.integers(1, 40),
)
def test_greedy_equals_generate(kind: str, seed: int, prompt: list[int], max_new: int) -> None:
    model = tiny_model(kind, seed=seed % 7)
    want = plain_greedy(model, prompt, max_new)
    gen = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=16)
    drafter = OracleDrafter(want + [0] * 10, len(prompt), np.random.default_rng(seed), 64)
    got = gen.generate(prompt, drafter=drafter, max_new_tokens=max_new)
    assert got.output_token_ids == want
    assert got.new_tokens <= max_new
    assert got.forward_passes <= max(1, len(want))


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_context_limit_and_eos(kind: str) -> None:
    model = tiny_model(kind, seed=3, max_positions=40)
    prompt = list(range(1, 30))
    want = plain_greedy(model, prompt, 10)
    gen = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=16)
    got = gen.generate(
        prompt, drafter=OracleDrafter(want + [0] * 20, len(prompt), np.random.default_rng(0), 64), max_new_tokens=10
    )
    assert got.output_token_ids == want[: len(got.output_token_ids)]
    assert len(prompt) + got.new_tokens <= 40


def test_eos_inside_an_accepted_path_stops_there() -> None:
    model = tiny_model("llama", seed=1)
    prompt = [5, 6, 7]
    want = plain_greedy(model, prompt, 6)
    eos = want[2]
    model.generation_config.eos_token_id = eos
    gen = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=16)
    chain = Draft(np.array(want), np.arange(-1, len(want) - 1, dtype=np.int32), np.arange(len(want), 0, -1), 1)

    class Fixed:
        def draft(self, context: list[int], max_nodes: int) -> Draft:
            return chain

    got = gen.generate(prompt, drafter=Fixed(), max_new_tokens=6)
    assert got.output_token_ids == want[: want.index(eos) + 1]
    assert got.stop_reason == "eos" and got.forward_passes == 1


def test_failing_drafter_changes_nothing() -> None:
    model = tiny_model("llama", seed=2)
    want = plain_greedy(model, [1, 2], 12)

    class Broken:
        def draft(self, context: list[int], max_nodes: int) -> Draft:
            raise ConnectionError("database down")

    got = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=8).generate(
        [1, 2], drafter=Broken(), max_new_tokens=12
    )
    assert got.output_token_ids == want


def test_unsupported_model_is_refused() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=20))
    with pytest.raises(ModelError, match="not supported"):
        SpeculativeGenerator(model, IdTokenizer())


def test_tree_layout_mask_and_acceptance() -> None:
    draft = Draft(np.array([10, 11, 12, 13]), np.array([-1, -1, 0, 2], dtype=np.int32), np.array([4, 3, 2, 1]), 2)
    order, parent_slot, depth = tree_layout(draft)
    assert depth.tolist() == [1, 1, 2, 3]
    mask = tree_mask(parent_slot)
    assert mask.sum(axis=1).tolist() == [1, 2, 2, 3, 4]  # root, two children, grandchild, great-grandchild
    tokens = np.concatenate(([99], draft.tokens[order]))
    kids = children_of(parent_slot, tokens)
    # target predicts 10 after the root, 12 after 10, then 50 (not drafted)
    predicted = {0: 10, 1: 12, 2: 0, 3: 50, 4: 7}
    slots, emitted = accept_greedy([predicted[i] for i in range(5)], kids)
    assert emitted == [10, 12, 50] and len(slots) == 2
