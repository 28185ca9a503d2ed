"""A stand-in for vLLM's model runner (`Runner`) and a `VllmConfig` for `CrestProposer` (`vllm_config`).

`Runner` holds the batch as vLLM does (`input_batch`, `requests`), calls `propose(sampled_token_ids,
num_tokens_no_spec, token_ids_cpu)` from its `propose_draft_token_ids(scheduler_output, ...)`, and plays a target
model that follows a known text, so it accepts the longest right prefix of each chain plus one token, as greedy
verification does. Given a model, its frame also holds what vLLM's does for the dense drafters:
`sample_hidden_states` (the model's last hidden states at the step's logits rows, `num_draft_tokens[i] + 1` per
row) and `spec_decode_metadata` (None when the step verified no draft).

For the slow tests: `VllmServer` runs vLLM's OpenAI server in a subprocess (greedy completions, seeded samples,
its /metrics); a private PostgreSQL a test may kill is
`tests.fix_db.OwnServer`.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from crest.bench.proposer import StandInClock
from crest.config import DEFAULT_STAND_IN_FORWARD
from crest.integrations.vllm import CrestProposer

EOS = 1  # the word tokenizer's [EOS]
K = 4
MAX_TOKENS = 40  # a greedy completion's length unless a test asks for another
# pytest-timeout counts a test function only (pyproject.toml): fixtures that start servers bound their own waits
START_TIMEOUT = 480.0  # seconds for a vLLM server to answer /health (about 2 minutes on 2 cores)
REQUEST_TIMEOUT = 240.0  # seconds for one completion


class Runner:
    """A stand-in for vLLM's model runner: requests that follow known token sequences, verified greedily."""

    def __init__(self, proposer: CrestProposer, *, width: int = 64, model: Any = None) -> None:
        self.proposer, self.width, self.model = proposer, width, model
        # the engine's time: a stand-in forward per step (no model runs), so the proposer's lookup gate weighs its
        # lookups against an engine's tokens/s, not against this loop's microseconds
        self.clock = proposer.clock = StandInClock(DEFAULT_STAND_IN_FORWARD)
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
        self.clock.tick()
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


def required_vllm_python() -> str:
    """Return `vllm_python()`, or skip the test (fail where CI requires vLLM) when there is none."""
    from tests.fix_require import require

    python = vllm_python()
    if python is None:
        require("vllm", "no Python with vLLM: set CREST_VLLM_PYTHON (.ci/vllm-venv builds one)")
    assert python is not None  # require skipped or failed otherwise
    return python


class VllmServer:
    """vLLM's OpenAI server in a subprocess (its own process group), up once /health answers."""

    def __init__(
        self,
        python: str,
        model: Path,
        log: Path,
        *,
        spec: dict[str, Any] | None,
        env: dict[str, str],
        max_seqs: int = 8,
    ) -> None:
        """Start the server."""
        import httpx

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.model, self.log = str(model), log
        self.url = f"http://127.0.0.1:{self.port}"
        args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--dtype", "float32"]
        args += ["--port", str(self.port), "--max-model-len", "1024", "--max-num-seqs", str(max_seqs)]
        args += ["--seed", "0", "-O0"]
        if spec is not None:
            args += ["--speculative-config", json.dumps(spec)]
        full = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "0-1", **env}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=full, start_new_session=True)
        limits = httpx.Limits(max_connections=max(max_seqs, 8))
        self.http = httpx.Client(base_url=self.url, timeout=REQUEST_TIMEOUT, limits=limits)
        self.max_seqs = max_seqs

    def wait_ready(self, *, timeout: float = START_TIMEOUT) -> None:
        """Wait until the server answers /health; fail with its log's tail when it exits or the deadline passes."""
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"vLLM exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                if self.http.get("/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)  # polling a condition under a deadline
        pytest.fail(f"vLLM did not answer within {timeout:.0f} s:\n{self.tail()}")

    def complete(self, prompts: list[str], *, max_tokens: int = MAX_TOKENS) -> list[str]:
        """Return the greedy completions of the prompts, sent at once (one batch)."""
        return [text for text, _ in self._many([self._body(p, max_tokens=max_tokens) for p in prompts])]

    def greedy(self, prompt: str, *, max_tokens: int) -> tuple[str, list[int]]:
        """Return the prompt's greedy completion: its text and its token ids."""
        return self._many([self._body(prompt, max_tokens=max_tokens)])[0]

    def sample(
        self, prompt: str, *, seeds: range, max_tokens: int, temperature: float, concurrency: int | None = None
    ) -> list[list[int]]:
        """Return the token ids of one sampled completion per seed (plain softmax: no top-k, no top-p), `concurrency`
        requests at a time (default `max_seqs`)."""
        options = {"temperature": temperature, "top_p": 1.0, "top_k": -1}
        bodies = [self._body(prompt, max_tokens=max_tokens, seed=seed, **options) for seed in seeds]
        return [ids for _, ids in self._many(bodies, concurrency=concurrency)]

    def _body(self, prompt: str, *, max_tokens: int, **options: Any) -> dict[str, Any]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
        return body | {"return_token_ids": True} | options  # the choice's "token_ids": what vLLM served

    def _many(self, bodies: list[dict[str, Any]], *, concurrency: int | None = None) -> list[tuple[str, list[int]]]:
        """Send the requests, `concurrency` at a time (default `max_seqs`); return each one's text and token ids."""

        def one(body: dict[str, Any]) -> tuple[str, list[int]]:
            reply = self.http.post("/v1/completions", json=body)
            reply.raise_for_status()
            choice = reply.json()["choices"][0]
            return str(choice["text"]), [int(t) for t in choice["token_ids"]]

        with ThreadPoolExecutor(min(len(bodies), concurrency or self.max_seqs)) as pool:
            return list(pool.map(one, bodies))

    def metrics(self) -> dict[str, float]:
        """Return vLLM's /metrics samples by name, summed over their labels."""
        found: dict[str, float] = {}
        for line in self.http.get("/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name = line.split("{")[0].split(" ")[0]
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return found

    def counters(self) -> dict[str, float]:
        """Return vLLM's spec-decode counters from /metrics (drafts, draft tokens, accepted tokens)."""
        return {
            name.removeprefix("vllm:spec_decode_num_"): value
            for name, value in self.metrics().items()
            if name.startswith("vllm:spec_decode_num_") and name.endswith("_total")
        }

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Stop the server's process group (SIGTERM, then SIGKILL after 60 s)."""
        self.http.close()
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
