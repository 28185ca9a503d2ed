"""crest inside a real vLLM at temperature > 0 (slow): seeded sampled requests drafted by crest's store have the
distribution of vLLM's own sampling without speculation, and the test has the power to see a rule that does not.

One vLLM without speculation gives the references (the prompt's greedy tokens; seeded samples) and stops. A store
holds only the prompt and its greedy text, so its deep keys are unique and it drafts the greedy continuation
(checked with `Store.draft` before any sample is drawn). One vLLM with `CrestProposer` (drafter `crest`, no
recent tier, no learning, no live refresh: every draft comes from that store) then samples with seeds of its own,
and the proposer's fix of vLLM 0.32.0's CPU expand kernel (`crest.integrations._vllm_sampling`: that build verifies
sampled rows with a garbage temperature, whoever drafts; the test asserts the proposer found and fixed it).
vLLM's rejection sampling is exact in distribution, not draw for draw (a draft changes which random numbers a row
uses), so the test compares where each sample first leaves the greedy text (position and token) with a
chi-square homogeneity test, asserts that many drafted tokens were accepted, and shows on the same samples that
the statistic rejects a rule that accepts every draft (the store's drafts are the greedy text). The fixture bounds
its own waits (pytest-timeout counts the test function only).
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from crest.config import IngestOptions
from crest.ingest.pipeline import ingest
from tests.fix_db import _database
from tests.fix_vllm import K, VllmServer, required_vllm_python

PROMPT = "class Stack:\n    def __init__(self):"  # greedy "\n        self.stack = []": likely, not certain, at T = 1
TEMPERATURE = 1.0
TOKENS = 6  # a sample's tokens: the first comes from the prompt's step (no draft), a draft of K covers the next ones
TAUGHT_TOKENS = 24  # the store holds this much of the prompt's greedy text
SAMPLES = 160  # seeded requests per server
CONCURRENCY = 4  # requests at a time: short steps on a loaded machine, and the policy drafts a small batch fully
ALPHA = 1e-3  # the test's significance: a right rule fails it one run in a thousand
FIXED = "crest replaced it with a torch one"  # what the proposer logs when it fixed vLLM's CPU expand kernel
POOLED = 10  # categories both servers' samples together hold fewer times than this are pooled (chi-square's rule:
# an expected count of at least 5 in each of the two columns)
OTHER = -2  # the pooled categories' position or token (-1 is the token of "no departure")
Category = tuple[int, int]  # (position, token) of a sample's first departure from the greedy text


@pytest.fixture(scope="module")
def store_dsn(pg_server: str, migrated_template: str) -> Iterator[str]:
    """A migrated database of this module's own (the session's `db_dsn` is per test)."""
    with _database(pg_server, template=migrated_template) as dsn:
        yield dsn


@pytest.fixture(scope="module")
def served(store_dsn: str, tmp_path_factory: pytest.TempPathFactory, smollm2_gguf: Path) -> Iterator[Any]:
    """vLLM's greedy tokens and seeded samples without speculation, then a vLLM sampling with CrestProposer
    (drafter crest) from a store of the prompt's greedy text."""
    from crest.decoding.export import export_hf

    python = required_vllm_python()
    root = tmp_path_factory.mktemp("vllm-sampling")
    model = export_hf("smollm2", root / "smollm2")
    plain = VllmServer(python, model, root / "plain.log", spec=None, env={})
    try:
        plain.wait_ready()
        taught, greedy = plain.greedy(PROMPT, max_tokens=TAUGHT_TOKENS)
        samples = plain.sample(PROMPT, seeds=range(SAMPLES), max_tokens=TOKENS, temperature=TEMPERATURE)
    finally:
        plain.stop()
    corpus = root / "taught.jsonl"
    corpus.write_text((json.dumps({"text": PROMPT + taught}) + "\n") * 20, encoding="utf-8")
    ingest([str(corpus)], store="sampled", tokenizer=str(smollm2_gguf), dsn=store_dsn, options=IngestOptions())
    assert_store_drafts_greedy(store_dsn, model, greedy)
    env = {"CREST_STORE": "sampled", "CREST_DRAFTER": "crest", "CREST_LEARN": "0", "CREST_RECENT": "0"}
    env |= {"CREST_REFRESH_INTERVAL": "0", "CREST_DATABASE_URL": store_dsn, "CREST_READ_DATABASE_URL": store_dsn}
    # lookups on a loaded machine can outrun the 10 ms default and draft nothing (see test_vllm.served)
    env |= {"CREST_LOOKUP_TIMEOUT": "0.5", "CREST_REPORT_INTERVAL": "1"}
    spec = {"method": "custom_class", "model": "crest.integrations.vllm.CrestProposer", "num_speculative_tokens": K}
    server = VllmServer(python, model, root / "crest.log", spec=spec, env=env)
    try:
        server.wait_ready()
        yield SimpleNamespace(server=server, greedy=greedy[:TOKENS], samples=samples)
    finally:
        server.stop()


def assert_store_drafts_greedy(dsn: str, model: Path, greedy: list[int]) -> None:
    """Assert that the store's best chain after the prompt and the first greedy token is the greedy text's next K
    tokens: what crest drafts for a sample whose first token is greedy."""
    from crest_client import Store
    from transformers import AutoTokenizer

    from crest.integrations.chain import best_chain

    prompt = [int(t) for t in AutoTokenizer.from_pretrained(str(model)).encode(PROMPT, add_special_tokens=False)]
    with Store.connect(dsn, "sampled") as store:
        chain = best_chain(store.draft(prompt + greedy[:1]), depth=K)
    assert chain.tokens.tolist() == greedy[1 : 1 + K], (chain.tokens.tolist(), greedy)


def departures(samples: list[list[int]], greedy: list[int]) -> Counter[Category]:
    """Count each sample's first departure from the greedy tokens: (position, token there), (length, -1) for none."""
    found: Counter[Category] = Counter()
    for ids in samples:
        at = next((i for i, (a, b) in enumerate(zip(ids, greedy, strict=False)) if a != b), min(len(ids), len(greedy)))
        found[(at, ids[at] if at < len(ids) else -1)] += 1
    return found


def pooled(counts: list[Counter[Category]], group: Callable[[Category], Category]) -> list[Counter[Category]]:
    """Return the counts with each category that all of them together hold fewer than POOLED times counted in its
    group instead."""
    total = sum(counts, Counter[Category]())
    merged: list[Counter[Category]] = [Counter() for _ in counts]
    for found, into in zip(counts, merged, strict=True):
        for category, n in found.items():
            into[category if total[category] >= POOLED else group(category)] += n
    return merged


def homogeneity_pvalue(first: list[list[int]], second: list[list[int]], greedy: list[int]) -> float:
    """Return the chi-square p-value that two sets of samples leave the greedy tokens alike, by (position, token):
    rare tokens pooled by position, then rare positions pooled together."""
    from scipy.stats import chi2_contingency

    counts = [departures(first, greedy), departures(second, greedy)]
    counts = pooled(counts, lambda c: (c[0], OTHER))
    counts = pooled(counts, lambda c: (OTHER, OTHER))
    a, b = counts
    table = np.array([[a[c], b[c]] for c in sorted(a.keys() | b.keys())], float)  # [categories, 2]
    if len(table) < 2:
        return 1.0
    return float(chi2_contingency(table.T, correction=False).pvalue)


def accept_every_draft(ids: list[int], greedy: list[int]) -> list[int]:
    """Return what a rule that accepts every draft would have served: the store drafts the greedy text, so a row
    whose first token is greedy keeps the greedy text from its first drafted token on."""
    return list(greedy[: len(ids)]) if ids[:1] == greedy[:1] else ids


@pytest.mark.slow
def test_sampled_requests_drafted_by_crest_keep_vllms_distribution(served: Any) -> None:
    server, greedy, reference = served.server, served.greedy, served.samples
    before = server.counters().get("accepted_tokens_total", 0.0)
    seeds = range(SAMPLES, 2 * SAMPLES)  # seeds of their own: these draws are independent of the reference's
    drawn = server.sample(PROMPT, seeds=seeds, max_tokens=TOKENS, temperature=TEMPERATURE, concurrency=CONCURRENCY)
    accepted = server.counters().get("accepted_tokens_total", 0.0) - before
    assert all(len(ids) == TOKENS for ids in drawn + reference)
    pvalue = homogeneity_pvalue(reference, drawn, greedy)
    fixed = FIXED in server.log.read_text(errors="replace")  # the proposer's fix of vLLM's CPU expand kernel
    assert pvalue > ALPHA, (pvalue, accepted, fixed, departures(reference, greedy), departures(drawn, greedy))
    assert fixed, f"the proposer did not say it fixed vLLM's CPU expand kernel:\n{server.tail(60)}"
    # about 1.7 accepted per sample when crest drafts the greedy text (departures from it are rejected)
    assert accepted >= SAMPLES / 2, f"crest's drafts were hardly accepted ({accepted:.0f}):\n{server.tail(60)}"
    # the statistic's power at this size: the same samples, served by a rule that accepts every draft
    biased = [accept_every_draft(ids, greedy) for ids in drawn]
    assert sum(b != d for b, d in zip(biased, drawn, strict=True)) >= SAMPLES / 4  # it would have changed many
    power = homogeneity_pvalue(reference, biased, greedy)
    assert power < 1e-6, (power, departures(biased, greedy))
    print(f"p {pvalue:.3g} (accept every draft: {power:.3g}); {accepted:.0f} draft tokens accepted")
