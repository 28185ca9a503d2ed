"""A stand-in for vLLM's model runner (`Runner`) and a `VllmConfig` for `CrestProposer` (`vllm_config`).

`Runner` holds the batch as vLLM does (`input_batch`, `requests`), calls `propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu)` from its `propose_draft_token_ids(scheduler_output, ...)`, and plays a target
model that follows a known text, so it accepts the longest right prefix of each chain plus one token, as greedy
verification does. Given a model, its frame also holds what vLLM's does for the dense drafters:
`sample_hidden_states` (the model's last hidden states at the step's logits rows, `num_draft_tokens[i] + 1` per
row) and `spec_decode_metadata` (None when the step verified no draft).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from crest.integrations.vllm import CrestProposer

EOS = 1  # the word tokenizer's [EOS]
K = 4


class Runner:
    """A stand-in for vLLM's model runner: requests that follow known token sequences, verified greedily."""

    def __init__(self, proposer: CrestProposer, *, width: int = 64, model: Any = None) -> None:
        self.proposer, self.width, self.model = proposer, width, model
        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(0, np.int32))
        self.requests: dict[str, Any] = {}
        self.targets: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.drafts: dict[str, list[int]] = {}
        self.steps = self.drafted = self.accepted = 0
        self.seen: list[tuple[int, int]] = []  # (row length, draft length) of every draft asked for

    def add(self, req_id: str, prompt: list[int], output: list[int]) -> None:
        """Queue a request whose greedy output is `output` (its first step reads the prompt)."""
        params = SimpleNamespace(max_tokens=len(output), stop_token_ids=[], all_stop_token_ids={EOS},
                                 ignore_eos=False, min_tokens=0)  # fmt: skip
        self.requests[req_id] = SimpleNamespace(sampling_params=params)
        self.targets[req_id], self.tokens[req_id] = prompt + output, list(prompt)

    def step(self) -> list[list[int]]:
        """Verify every row's draft, drop finished rows (as vLLM's scheduler does) and ask for the next drafts."""
        sampled: list[list[int]] = []
        rows: list[Any] = []  # per row, the hidden states [d + 1, H] of the logits rows of its draft of d tokens
        for req_id in list(self.tokens):
            have, target, draft = self.tokens[req_id], self.targets[req_id], self.drafts.get(req_id, [])
            right = 0
            while right < len(draft) and len(have) + right < len(target) and draft[right] == target[len(have) + right]:
                right += 1
            new = target[len(have) : len(have) + right + 1]
            if self.model is not None:
                rows.append(self._states(target, len(have) - 1, len(draft) + 1))
            self.drafted, self.accepted = self.drafted + len(draft), self.accepted + right
            have.extend(new)
            sampled.append(new)
        self.steps += 1
        ids = list(self.tokens)
        self.input_batch.req_ids = ids
        self.input_batch.num_prompt_tokens = np.array(
            [len(self.targets[r]) - self.requests[r].sampling_params.max_tokens for r in ids], np.int32
        )
        lengths = np.array([len(self.tokens[r]) for r in ids], np.int32)
        token_ids = np.zeros((len(ids), self.width), np.int32)
        for i, r in enumerate(ids):
            token_ids[i, : lengths[i]] = self.tokens[r]
        scheduler_output = SimpleNamespace(total_num_scheduled_tokens=int(lengths.sum()))
        states = torch.cat(rows) if rows else None  # [sum(d) + rows, H]
        drafted = [len(self.drafts.get(r, [])) for r in ids]
        meta = SimpleNamespace(num_draft_tokens=drafted) if any(drafted) else None
        drafts = self.propose_draft_token_ids(scheduler_output, sampled, lengths, token_ids, states, meta)
        self.drafts = dict(zip(ids, drafts, strict=True))
        self.seen += [(int(n), len(d)) for n, d in zip(lengths, drafts, strict=True)]
        for r in ids:  # a finished request leaves the batch before the next step, as in vLLM
            if len(self.tokens[r]) >= len(self.targets[r]):
                del self.tokens[r]
        return drafts

    def propose_draft_token_ids(
        self,
        scheduler_output: Any,
        sampled: list[list[int]],
        lengths: np.ndarray,
        token_ids: np.ndarray,
        sample_hidden_states: Any = None,
        spec_decode_metadata: Any = None,
    ) -> list[list[int]]:
        """Call the proposer as vLLM's runner does (its frame holds the batch and the logits rows' states)."""
        return self.proposer.propose(sampled, lengths, token_ids, slot_mappings=None)

    def _states(self, target: list[int], first: int, count: int) -> torch.Tensor:
        """Return the model's last hidden states at positions first .. first + count - 1 of `target` (zeros past it)."""
        from crest.decoding.hidden import final_hidden

        hidden = final_hidden(self.model, torch.tensor([target]))[0]  # [T, H]
        out = torch.zeros(count, hidden.shape[1])
        take = hidden[first : first + count]
        out[: take.shape[0]] = take
        return out

    def run(self, *, limit: int = 200) -> None:
        """Step until every request finished (and once more, so the proposer sees them gone)."""
        while self.tokens and self.steps < limit:
            self.step()
        self.step()


def vllm_config(tokenizer: Path, *, k: int = K, max_len: int = 64, vocab: int = 9) -> Any:
    model = SimpleNamespace(max_model_len=max_len, tokenizer=str(tokenizer), model=str(tokenizer),
                            get_vocab_size=lambda: vocab)  # fmt: skip
    return SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=k), model_config=model)


def vllm_python() -> str | None:
    """Return a Python that imports vLLM: CREST_VLLM_PYTHON, else this one when it has vLLM, else None."""
    import importlib.util
    import os
    import sys

    given = os.environ.get("CREST_VLLM_PYTHON")
    if given:
        return given
    return sys.executable if importlib.util.find_spec("vllm") is not None else None
