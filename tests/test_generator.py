"""The speculative generator on the real SmolLM2-135M-Instruct: greedy output equals `model.generate` token for
token, and sampling through the trees of real drafters (a store ingested into PostgreSQL, merged with prompt
lookup) has the distribution the model's own logits give."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from crest_client.draft import Draft

from crest.bench.generate import generate_plain
from crest.decoding.generator import SpeculativeGenerator
from crest.drafters.merged import MergedDrafter
from crest.drafters.prompt import PromptDrafter

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


@pytest.mark.slow
@pytest.mark.parametrize(("prompt", "chat"), PROMPTS, ids=[f"p{i}" for i in range(len(PROMPTS))])
def test_greedy_equals_generate_on_smollm2(smollm2_model: Any, prompt: str, chat: bool) -> None:
    ids = smollm2_model.encode_prompt(prompt, chat=chat)
    model, tok = smollm2_model.model, smollm2_model.tokenizer
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


# ---- sampling through real drafters --------------------------------------------------------------------------

PETS_PROMPT = "The cat sat on the mat. The cat sat on the"  # 12 tokens: the prompt drafter drafts " mat"
PETS_CORPUS = [  # after "cat sat on the" the store drafts " mat", " bed" and " cat": the model's top three
    "The cat sat on the mat and purred.",
    "Our cat sat on the bed all afternoon, watching the rain.",
    "The big cat sat on the cat's blanket and would not move.",
    "Then the cat sat on the bed again.",
    "The dog sat on the mat by the door.",
]
TEMPERATURE, TOP_K = 1.0, 3
TRIALS = 100
ALPHA = 1e-3  # the test fails below this p-value


def topk_probs(model: Any, ids: list[int]) -> dict[int, float]:
    """Return the next-token distribution softmax(logits / T) over the top-k tokens, from a plain forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double()
    top = torch.topk(logits, TOP_K)
    probs = torch.softmax(top.values / TEMPERATURE, dim=-1)
    return {int(t): float(p) for t, p in zip(top.indices, probs, strict=True)}


def pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Return the chi-square p-value of counts against probabilities (cells expecting < 5 pooled)."""
    from scipy.stats import chisquare

    expected = probs * counts.sum()
    small = expected < 5
    observed = np.append(counts[~small], counts[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def shared_uniform_joint(first: dict[int, float], second: dict[int, dict[int, float]], drafted: set[int]) -> dict:
    """Return the two-token distribution of a biased sampler that draws every tree node with one uniform.

    Each node's marginal stays right (inverse CDF over token ids, as `torch.multinomial` orders them), so only
    the pairs that go through a drafted root child are off: the second token is tied to where the first fell.
    """
    joint: dict[tuple[int, int], float] = {}
    low = 0.0
    for a in sorted(first):
        high = low + first[a]
        cut = 0.0
        for b in sorted(second[a]):
            overlap = max(0.0, min(high, cut + second[a][b]) - max(low, cut))  # u in [low, high) also picks b
            joint[(a, b)] = overlap if a in drafted else first[a] * second[a][b]
            cut += second[a][b]
        low = high
    return joint


@pytest.fixture()
def pets_store(db_dsn: str, smollm2_gguf: Path, tmp_path: Path) -> Iterator[Any]:
    """Store `pets` ingested from a small real corpus with the SmolLM2 tokenizer, opened through the SDK."""
    from crest_client import Store

    from crest.config import IngestOptions
    from crest.ingest.pipeline import ingest

    corpus = tmp_path / "pets.jsonl"
    corpus.write_text("".join(json.dumps({"text": t}) + "\n" for t in PETS_CORPUS * 3))
    opts = IngestOptions(top_t=10_000)
    ingest([str(corpus)], store="pets", tokenizer=str(smollm2_gguf), dsn=db_dsn, options=opts)
    with Store.connect(db_dsn, "pets", timeout=5.0) as store:
        yield store


@pytest.mark.slow
def test_sampling_through_a_real_store_and_the_prompt_has_the_models_distribution(
    smollm2_model: Any, pets_store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """First two tokens at temperature 1, top-3, drafted by crest+prompt: chi-square against the model's logits.

    The expected joint distribution is computed here from plain forwards (softmax of the top-3 logits), not
    through crest. The drafted root children carry most of the first token's probability, so most trials go
    through the tree. Power: against a sampler that draws every node of a step with one shared uniform (right
    marginals, wrong joint), the test computes the biased distribution exactly and simulates the chi-square at
    this sample size: it rejects with probability >= 0.99 (asserted below; with the drafts seen so far, 1.0).
    Run with that sampler in place of `sample_nodes`, the test failed with p = 4e-9. About 1.5 min on 2 threads.
    """
    import crest.decoding.generator
    from crest.decoding.sampling import children_of
    from crest.drafters.registry import make_drafter

    model, tok = smollm2_model.model, smollm2_model.tokenizer
    ids = smollm2_model.encode_prompt(PETS_PROMPT)
    first = topk_probs(model, ids)
    second = {a: topk_probs(model, ids + [a]) for a in first}
    eos = np.atleast_1d(model.generation_config.eos_token_id or tok.eos_token_id).tolist()
    assert not set(eos) & (set(first) | {b for d in second.values() for b in d}), "an outcome ends the generation"
    cells = [(a, b) for a in sorted(first) for b in sorted(second[a])]
    exact = np.array([first[a] * second[a][b] for a, b in cells])

    roots: list[set[int]] = []  # the drafted root tokens of each trial's first step, as acceptance saw them
    first_step = [False]

    def spy(parent_slot: np.ndarray, tokens: np.ndarray) -> list[dict[int, int]]:
        kids = children_of(parent_slot, tokens)
        if first_step[0]:
            roots.append(set(kids[0]))
            first_step[0] = False
        return kids

    monkeypatch.setattr(crest.decoding.generator, "children_of", spy)
    gen = SpeculativeGenerator(model, tok, max_draft_tokens=32)  # cut to depth 1 (2 tokens): the roots stay
    counts = np.zeros(len(cells))
    counts_by_trial: list[tuple[int, int]] = []
    for seed in range(TRIALS):
        drafter = make_drafter("crest+prompt", store=pets_store)  # fresh: no learned scales carried over
        first_step[0] = True
        out = gen.generate(
            ids, drafter=drafter, max_new_tokens=2, temperature=TEMPERATURE, top_k=TOP_K, seed=seed
        ).output_token_ids
        pair = (out[0], out[1])
        assert pair in cells, f"{pair} is outside the top-{TOP_K} support"
        counts_by_trial.append(pair)
        counts[cells.index(pair)] += 1

    assert len(roots) == TRIALS
    through_tree = np.mean([a in drafted for (a, _), drafted in zip(counts_by_trial, roots, strict=True)])
    assert through_tree > 0.8, f"only {through_tree:.0%} of the trials went through the tree"
    p = pvalue(counts, exact)
    assert p > ALPHA, (p, counts.tolist(), (exact * TRIALS).round(1).tolist())

    biased = np.zeros(len(cells))
    for drafted in roots:  # the mixture over the trees the trials saw
        joint = shared_uniform_joint(first, second, drafted)
        biased += np.array([joint[c] for c in cells]) / len(roots)
    rng = np.random.default_rng(0)
    power = np.mean([pvalue(rng.multinomial(TRIALS, biased).astype(float), exact) < ALPHA for _ in range(2000)])
    assert power >= 0.99, f"the test would catch the biased sampler with probability {power:.3f} only"
