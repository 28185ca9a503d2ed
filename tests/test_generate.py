"""On the real SmolLM2-135M-Instruct: speculative greedy output equals model.generate token for token;
and on a tiny model: sampled speculative output has the distribution of plain sampling."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch
from crest_client.draft import Draft
from scipy.stats import chisquare

from crest.bench.generate import generate_plain
from crest.decoding.generator import SpeculativeGenerator
from crest.decoding.sampling import accept_sampled, process_logits
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter
from tests.fix_models import IdTokenizer, tiny_model

PROMPTS = [
    ("Write a Python function that checks whether a number is prime.", True),
    ("Explain the difference between a list and a tuple in Python.", True),
    ("def quicksort(arr):\n", False),
    ("Give me three tips for writing clear commit messages.", True),
    ("What is the capital of France? Answer in one sentence, then repeat the answer.", True),
    ("import json\n\ndef load(path):\n    with open(path) as f:\n", False),
    ("Summarise the plot of Romeo and Juliet.", True),
    ("List the numbers from 1 to 30 separated by commas.", True),
    ("class Stack:\n    def __init__(self):\n", False),
    ("Translate 'good morning, how are you?' into French and Spanish.", True),
    ("SELECT name, count(*) FROM users", False),
]


@pytest.fixture(scope="module")
def smollm2() -> object:
    from crest.decoding.models import load_model

    torch.set_num_threads(2)
    return load_model("smollm2")


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "chat"), PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_greedy_equals_generate_on_smollm2(smollm2: object, prompt: str, chat: bool) -> None:
    ids = smollm2.encode_prompt(prompt, chat=chat)  # type: ignore[attr-defined]
    model, tok = smollm2.model, smollm2.tokenizer  # type: ignore[attr-defined]
    want = generate_plain(model, tok, ids, max_new_tokens=64)
    drafter = MergedDrafter(PromptDrafter(), _NoisyOracle(want.output_token_ids, len(ids)))
    got = SpeculativeGenerator(model, tok, max_draft_tokens=12).generate(ids, drafter=drafter, max_new_tokens=64)
    assert got.output_token_ids == want.output_token_ids
    assert got.forward_passes < got.new_tokens  # real multi-token acceptances happened


class _NoisyOracle:
    """Drafts the reference continuation with one wrong sibling per level, so paths are partly rejected."""

    def __init__(self, reference: list[int], prompt_len: int) -> None:
        self.reference, self.prompt_len = reference, prompt_len

    def draft(self, context: Sequence[int], max_nodes: int) -> Draft | None:
        done = len(context) - self.prompt_len
        truth = self.reference[done : done + 4]
        if not truth:
            return None
        tokens, parents = [], []
        for i, t in enumerate(truth):
            tokens += [t, (t + 1) % 49152]
            parents += [2 * (i - 1) if i else -1] * 2
        return Draft(np.array(tokens), np.array(parents, dtype=np.int32), np.arange(len(tokens), 0, -1), 1)


def test_sampling_distribution_equals_plain_sampling() -> None:
    """First two tokens: speculative sampling with a biased tree vs the model's exact two-step distribution."""
    torch.set_num_threads(1)
    vocab = 8
    model = tiny_model("llama", seed=5, vocab=vocab)
    model.generation_config.eos_token_id = None  # two tokens always, for the joint distribution
    prompt = [1, 2, 3]
    with torch.no_grad():
        first = process_logits(model(torch.tensor([prompt])).logits[0, -1:], temperature=0.8, top_k=0, top_p=1.0)[0]
        exact = np.zeros((vocab, vocab))
        for a in range(vocab):
            second = process_logits(
                model(torch.tensor([prompt + [a]])).logits[0, -1:], temperature=0.8, top_k=0, top_p=1.0
            )[0]
            exact[a] = (first[a] * second).numpy()
    draft = Draft(np.array([0, 1, 2, 0]), np.array([-1, -1, 0, 1], dtype=np.int32), np.array([4, 3, 2, 1]), 1)

    class Fixed:
        def draft(self, context: Sequence[int], max_nodes: int) -> Draft:
            return draft

    gen = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=4)
    trials = 3000
    observed = np.zeros((vocab, vocab))
    for s in range(trials):
        out = gen.generate(prompt, drafter=Fixed(), max_new_tokens=2, temperature=0.8, seed=s).output_token_ids
        observed[out[0], out[1]] += 1
    expected = exact.ravel() * trials
    keep = expected > 5
    stat = chisquare(observed.ravel()[keep], expected[keep] * observed.ravel()[keep].sum() / expected[keep].sum())
    assert stat.pvalue > 1e-3, stat


def test_chi_square_rejects_a_biased_acceptance_rule() -> None:
    """The same test has the power to catch a rule that always accepts the first child."""
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.3, 0.3, 0.4], [0.5, 0.25, 0.25]])
    kids = [{0: 1, 1: 2}, {}, {}]

    def biased(generator: torch.Generator) -> int:
        return 0 if torch.rand(1, generator=generator).item() < 0.5 else accept_sampled(probs, kids, generator)[1][0]

    g = torch.Generator().manual_seed(0)
    fair = np.bincount([accept_sampled(probs, kids, g)[1][0] for _ in range(3000)], minlength=3)
    bad = np.bincount([biased(g) for _ in range(3000)], minlength=3)
    expected = probs[0].double().numpy() / probs[0].double().sum().item() * 3000
    assert chisquare(fair, expected).pvalue > 1e-3
    assert chisquare(bad, expected).pvalue < 1e-6
