"""Sampling is lossless: speculative sampling through a draft tree has the distribution of plain sampling
(chi-square against the exact distribution, with the power to reject a biased rule), in the single-sequence
generator and in the batched scheduler (seeded sampled rows drafting from a real store and their prompt, batched
with greedy rows, draw exactly what they draw alone), and the logits processing matches transformers' own warpers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
import torch
from crest_client.draft import Draft

from crest.decoding.generator import SpeculativeGenerator
from tests.fix_models import IdTokenizer, tiny_model

pytestmark = pytest.mark.usefixtures("torch_threads")  # one torch thread per test, restored after

SAMPLING = [
    {"temperature": 0.9, "top_k": 0, "top_p": 1.0},
    {"temperature": 1.3, "top_k": 4, "top_p": 0.9},
]


def hf_distribution(model: Any, ids: list[int], options: dict[str, Any]) -> np.ndarray:
    """Return the next-token distribution `generate` samples from, through transformers' own warpers."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = LogitsProcessorList([TemperatureLogitsWarper(options["temperature"])])
    if options["top_k"]:
        warpers.append(TopKLogitsWarper(options["top_k"]))
    if options["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(options["top_p"]))
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[:, -1].float()
        scores = warpers(torch.LongTensor([ids]), logits)
    return scores.double().softmax(dim=-1)[0].numpy()


def two_token_distribution(model: Any, prompt: list[int], options: dict[str, Any]) -> np.ndarray:
    """Return the exact joint distribution [V, V] of the first two sampled tokens."""
    first = hf_distribution(model, prompt, options)
    return np.stack([first[a] * hf_distribution(model, prompt + [a], options) for a in range(first.shape[0])])


def two_token_counts(gen: SpeculativeGenerator, prompt: list[int], draft: Draft, trials: int, **options: Any):
    """Return the counts [V, V] of the first two tokens over `trials` seeded speculative generations."""

    class Fixed:
        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft:
            return draft

    counts = np.zeros((gen.vocab, gen.vocab))
    for seed in range(trials):
        out = gen.generate(prompt, drafter=Fixed(), max_new_tokens=2, seed=seed, **options).output_token_ids
        counts[out[0], out[1]] += 1
    return counts


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Return the chi-square p-value of counts against probabilities (cells expecting < 5 pooled)."""
    from scipy.stats import chisquare

    expected = probs.ravel() * counts.sum()
    small = expected < 5
    observed = np.append(counts.ravel()[~small], counts.ravel()[small].sum())
    expected = np.append(expected[~small], expected[small].sum())
    if expected[-1] == 0:
        observed, expected = observed[:-1], expected[:-1]
    return float(chisquare(observed, expected * observed.sum() / expected.sum()).pvalue)


def sampling_setup() -> tuple[Any, SpeculativeGenerator, list[int], Draft]:
    model = tiny_model("llama", seed=5, vocab=6)
    model.generation_config.eos_token_id = None  # two tokens always, for the joint distribution
    prompt = [1, 2, 3]
    top = int(np.argmax(hf_distribution(model, prompt, SAMPLING[0])))
    tokens = [top, (top + 1) % 6, (top + 2) % 6, 0, 1, 2, 4]
    draft = Draft(np.array(tokens), np.array([-1, -1, -1, 0, 0, 1, 3], dtype=np.int32), np.arange(7, 0, -1), 1)
    return model, SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=7), prompt, draft


@pytest.mark.parametrize("options", SAMPLING, ids=["temperature", "top-k-top-p"])
def test_sampled_tokens_have_the_distribution_of_plain_sampling(options: dict[str, Any]) -> None:
    model, gen, prompt, draft = sampling_setup()
    counts = two_token_counts(gen, prompt, draft, 1500, **options)
    pvalue = chi_square_pvalue(counts, two_token_distribution(model, prompt, options))
    assert pvalue > 1e-3, pvalue


def bias_acceptance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the sampled acceptance rule: accept any drafted child the target finds plausible (p >= 0.1)."""
    import crest.decoding.generator
    from crest.decoding.sampling import sample_nodes

    seen: dict[str, torch.Tensor] = {}

    def spy(probs: torch.Tensor, generator: torch.Generator | None = None) -> list[int]:
        seen["probs"] = probs
        return sample_nodes(probs, generator)

    def lenient(picks: Sequence[int], kids: list[dict[int, int]]) -> tuple[list[int], list[int]]:
        slots: list[int] = []
        emitted: list[int] = []
        current = 0
        while True:
            plausible = [(t, s) for t, s in kids[current].items() if seen["probs"][current, t] >= 0.1]
            if not plausible:
                emitted.append(int(picks[current]))
                return slots, emitted
            token, current = plausible[0]
            slots.append(current)
            emitted.append(token)

    monkeypatch.setattr(crest.decoding.generator, "sample_nodes", spy)
    monkeypatch.setattr(crest.decoding.generator, "accept_greedy", lenient)


def test_chi_square_rejects_a_biased_acceptance_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same test catches a rule that accepts any drafted child the target finds plausible (p >= 0.1)."""
    model, gen, prompt, draft = sampling_setup()
    bias_acceptance(monkeypatch)
    counts = two_token_counts(gen, prompt, draft, 600, **SAMPLING[0])
    assert chi_square_pvalue(counts, two_token_distribution(model, prompt, SAMPLING[0])) < 1e-6


def test_same_seed_same_output_and_seeds_differ() -> None:
    model = tiny_model("qwen2", seed=1)
    gen = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=4)
    runs = [gen.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, seed=s).output_token_ids for s in (7, 7, 8)]
    assert runs[0] == runs[1] != runs[2]


@pytest.mark.parametrize(
    "options",
    [
        {"temperature": 0.7, "top_k": 0, "top_p": 1.0},
        {"temperature": 1.0, "top_k": 5, "top_p": 1.0},
        {"temperature": 1.0, "top_k": 0, "top_p": 0.8},
        {"temperature": 0.5, "top_k": 10, "top_p": 0.5},
    ],
    ids=["temperature", "top-k", "top-p", "all"],
)
def test_process_logits_matches_transformers_warpers(options: dict[str, Any]) -> None:
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from crest.decoding.sampling import process_logits

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    warpers = LogitsProcessorList([TemperatureLogitsWarper(options["temperature"])])
    if options["top_k"]:
        warpers.append(TopKLogitsWarper(options["top_k"]))
    if options["top_p"] < 1.0:
        warpers.append(TopPLogitsWarper(options["top_p"]))
    want = warpers(torch.LongTensor([[0]] * 6), logits.clone()).softmax(dim=-1)
    torch.testing.assert_close(process_logits(logits, **options), want)


def batched_two_token_counts(model: Any, prompt: list[int], draft: Draft, trials: int, **options: Any):
    """Return the counts [V, V] of the first two tokens of `trials` seeded sampled rows through the batched
    scheduler, a greedy row beside every fourth (each checked against greedy decoding), and the draft tokens the
    sampled rows accepted."""
    from crest.decoding.sizing import CostModel
    from crest.serving.scheduler import Request, Scheduler
    from tests.fix_serving import drive

    class Fixed:
        def draft(self, context_ids: Sequence[int], max_nodes: int) -> Draft:
            return draft

    sched = Scheduler(model, IdTokenizer(), max_batch=8, cost=CostModel([1, 64], [1.0, 1.0]), max_draft_tokens=7)
    requests = []
    for seed in range(trials):
        requests.append(Request(prompt, max_tokens=2, drafter=Fixed(), seed=seed, **options))
        if seed % 4 == 0:
            requests.append(Request(prompt, max_tokens=2, drafter=Fixed()))
    outcomes = drive(sched, [(i // 4, r) for i, r in enumerate(requests)], limit=2 * len(requests))  # 4 join a step
    greedy = SpeculativeGenerator(model, IdTokenizer()).generate(prompt, max_new_tokens=2).output_token_ids
    counts = np.zeros((sched.gen.vocab, sched.gen.vocab))
    accepted = 0
    for request, outcome in zip(requests, outcomes, strict=True):
        out = outcome.result.output_token_ids
        if request.temperature == 0:
            assert out == greedy
        else:
            counts[out[0], out[1]] += 1
            accepted += outcome.accepted_draft_tokens
    return counts, accepted


@pytest.mark.parametrize("options", SAMPLING, ids=["temperature", "top-k-top-p"])
def test_batched_sampled_rows_have_the_distribution_of_plain_sampling(options: dict[str, Any]) -> None:
    model, _, prompt, draft = sampling_setup()
    counts, accepted = batched_two_token_counts(model, prompt, draft, 1500, **options)
    assert accepted > 100, "the sampled rows hardly verified their drafts"
    pvalue = chi_square_pvalue(counts, two_token_distribution(model, prompt, options))
    assert pvalue > 1e-3, pvalue


def test_batched_chi_square_rejects_a_biased_acceptance_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """The power of the batched test: the biased rule, through the scheduler, is rejected with 600 rows."""
    model, _, prompt, draft = sampling_setup()
    bias_acceptance(monkeypatch)
    counts, _ = batched_two_token_counts(model, prompt, draft, 600, **SAMPLING[0])
    assert chi_square_pvalue(counts, two_token_distribution(model, prompt, SAMPLING[0])) < 1e-6


def store_and_prompt_drafter(dsn: str) -> tuple[Any, Any]:
    """Return a fresh crest+prompt drafter over store `six` (chains of tokens below 6) and the store it reads."""
    from crest_client import Store

    from crest.drafters.registry import make_drafter

    store = Store.connect(dsn, "six", cache_size=0, timeout=5.0)
    return make_drafter("crest+prompt", store=store), store


def test_batched_sampled_rows_with_store_and_prompt_drafts_draw_what_they_draw_alone(db_dsn: str) -> None:
    """Seeded sampled rows drafting from a real store and their prompt, batched with greedy rows, emit exactly the
    tokens the single-sequence generator emits for the same seed (the same trees, the same draws)."""
    from crest.decoding.sizing import CostModel
    from crest.serving.scheduler import Request, Scheduler
    from tests.fix_serving import drive
    from tests.fix_store import chain_tree, publish

    publish(db_dsn, "six", {(a,): chain_tree(a % 3, 3) for a in range(6)} | {(2, 3): chain_tree(3, 3)})
    model, _, _, _ = sampling_setup()
    flat = CostModel([1, 64], [1.0, 1.0])  # drafting always pays: whole trees, whatever the batch
    prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5, 4], [2, 3], [5, 1, 0, 2, 3, 3], [3, 1, 2, 3, 1]]
    rows: list[tuple[list[int], dict[str, Any]]] = [
        (p, {"temperature": 0.9, "seed": 40 + i} if i % 2 == 0 else {}) for i, p in enumerate(prompts)
    ]
    opened = [store_and_prompt_drafter(db_dsn) for _ in rows]
    try:
        sched = Scheduler(model, IdTokenizer(), max_batch=4, cost=flat, max_draft_tokens=7)
        requests = [Request(p, max_tokens=16, drafter=d, **o) for (p, o), (d, _) in zip(rows, opened, strict=True)]
        outcomes = drive(sched, list(enumerate(requests)))
        alone = SpeculativeGenerator(model, IdTokenizer(), max_draft_tokens=7, cost=flat)
        for (prompt, options), outcome in zip(rows, outcomes, strict=True):
            drafter, store = store_and_prompt_drafter(db_dsn)
            try:
                want = alone.generate(prompt, drafter=drafter, max_new_tokens=16, **options).output_token_ids
            finally:
                store.close()
            assert outcome.result.output_token_ids == want, (prompt, options)
        sampled = [o for (_, opts), o in zip(rows, outcomes, strict=True) if opts]
        assert sum(o.accepted_draft_tokens for o in sampled) > 0, "no sampled row accepted a draft"
    finally:
        for _, store in opened:
            store.close()
