"""The dense drafters inside vLLM's proposer: the hidden states of vLLM's logits rows, read from its model runner,
query the store's dense part (real PostgreSQL with pgvector, the tiny random model of `tests.fix_dense`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from crest.config import VllmSettings
from crest.decoding.generator import SpeculativeGenerator
from crest.errors import ModelError
from crest.ingest.pipeline import ingest
from crest.integrations._vllm_runner import last_states
from crest.integrations.vllm import CrestProposer
from tests.fix_dense import OPTIONS, PROMPTS, save_tiny
from tests.fix_vllm import Runner, vllm_config

pytest_plugins = ["tests.fix_dense"]


def test_last_states_take_each_rows_last_sampled_logits_row() -> None:
    states = torch.arange(7, dtype=torch.float32)[:, None].repeat(1, 3)  # [7, 3]: row j holds j
    meta = type("Meta", (), {"num_draft_tokens": [2, 0, 1, 0]})()  # logits rows 0-2, 3, 4-5, 6
    found = last_states(states, meta, [[5, 6], [7], [], [8]])  # 2 of 3, 1 of 1, a prompt still read, 1 of 1
    assert found is not None and [None if f is None else int(f[0]) for f in found] == [1, 3, None, 6]
    assert last_states(states, None, [[1]] * 7) is not None  # no draft verified: one row each
    assert last_states(states, meta, [[1]] * 3) is None  # another layout than vLLM's: no states, no guess


def _requests(loaded: Any) -> list[tuple[str, list[int], list[int]]]:
    """The prompts the dense part's corpus continues, with the tiny model's greedy continuations of them."""
    gen = SpeculativeGenerator(loaded.model, loaded.tokenizer, adaptive=False)
    out = []
    for i, prompt in enumerate(PROMPTS):
        ids = loaded.tokenizer(prompt)["input_ids"]
        out.append((f"r{i}", ids, gen.generate(ids, max_new_tokens=40).output_token_ids))
    return out


@pytest.mark.parametrize("drafter", ["dense", "crest+dense+prompt"])
def test_vllm_proposer_drafts_from_the_dense_part_with_the_runners_states(
    db_dsn: str, dense_store: Any, tiny_dir: Path, loaded: Any, drafter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import crest.integrations.vllm as vllm_module
    from crest.decoding.hidden import final_hidden

    settings = VllmSettings(store="words", drafter=drafter, dsn=db_dsn, read_dsn=db_dsn, learn=False)
    proposer = CrestProposer(vllm_config(tiny_dir, max_len=128, vocab=32), settings=settings)
    fed: list[tuple[list[int], np.ndarray]] = []  # (the row's tokens, the state handed to its drafter)

    def spy(drafter: Any, context_length: int, state: np.ndarray | None) -> None:
        row = next(r for r in proposer._rows.values() if r.drafter is drafter)
        assert context_length == len(row.tokens)
        if state is not None:
            fed.append((list(row.tokens), state))
        feed(drafter, context_length, state)

    feed = vllm_module.feed_hidden
    monkeypatch.setattr(vllm_module, "feed_hidden", spy)
    try:
        proposer.load_model(loaded.model)
        runner = Runner(proposer, model=loaded.model)
        requests = _requests(loaded)
        for req_id, prompt, output in requests:
            runner.add(req_id, prompt, output)
        runner.run()
        tokens = sum(len(o) for _, _, o in requests)
        assert proposer.name == drafter and proposer.dense is not None
        # the dense part holds these very continuations: most tokens come in accepted chains
        assert runner.accepted > tokens / 2 and runner.steps < tokens / 2
        # each state is the one that predicted the row's last token, also after steps that sampled several
        assert len(fed) >= runner.steps
        for context, state in fed:
            want = final_hidden(loaded.model, torch.tensor([context]))[0, -2].numpy()  # [H]: it predicted context[-1]
            assert np.allclose(state, want, atol=1e-4)
    finally:
        proposer.close()


def test_vllm_proposer_without_the_runners_states_drafts_nothing_dense(
    db_dsn: str, dense_store: Any, tiny_dir: Path, loaded: Any
) -> None:
    settings = VllmSettings(store="words", drafter="dense", dsn=db_dsn, read_dsn=db_dsn, learn=False)
    proposer = CrestProposer(vllm_config(tiny_dir, max_len=128, vocab=32), settings=settings)
    try:
        proposer.load_model(loaded.model)
        runner = Runner(proposer)  # a runner whose frame holds no hidden states (another vLLM)
        for req_id, prompt, output in _requests(loaded):
            runner.add(req_id, prompt, output)
        runner.run()
        assert runner.drafted == 0 and runner.accepted == 0  # no draft, no error
    finally:
        proposer.close()


def test_another_models_dense_part_stops_vllm_at_load(
    db_dsn: str, dense_store: Any, tiny_dir: Path, tmp_path: Path
) -> None:
    from crest.decoding.models import load_model

    other = load_model(str(save_tiny(tmp_path / "other", seed=4))).model  # same shape and tokenizer, other weights
    settings = VllmSettings(store="words", drafter="dense", dsn=db_dsn, read_dsn=db_dsn, learn=False)
    proposer = CrestProposer(vllm_config(tiny_dir, max_len=128, vocab=32), settings=settings)
    try:
        with pytest.raises(ModelError, match="dense part was built with model"):
            proposer.load_model(other)
    finally:
        proposer.close()


def test_a_store_without_a_dense_part_drafts_without_it(
    db_dsn: str, corpus: Path, tiny_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ingest([str(corpus)], store="words", tokenizer=str(tiny_dir), dsn=db_dsn, options=OPTIONS)  # n-grams only
    settings = VllmSettings(store="words", drafter="crest+dense+prompt", dsn=db_dsn, read_dsn=db_dsn, learn=False)
    with caplog.at_level(logging.WARNING, logger="crest.integrations.vllm"):
        proposer = CrestProposer(vllm_config(tiny_dir, max_len=128, vocab=32), settings=settings)
    try:
        assert proposer.name == "crest+prompt" and proposer.dense is None and proposer.store is not None
        assert "dense part cannot be used" in caplog.text and "drafting with crest+prompt" in caplog.text
    finally:
        proposer.close()


def test_states_are_float32_on_the_host() -> None:
    states = torch.ones(2, 4, dtype=torch.bfloat16)
    found = last_states(states, None, [[3], [4]])
    assert found is not None and all(isinstance(f, np.ndarray) and f.dtype == np.float32 for f in found)
