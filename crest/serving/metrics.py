"""Prometheus metrics of a server: requests, tokens, accepted tokens per step, draft latency, queue depth, batch size,
learning (tokens written to the stores' learned logs or dropped, the live tiers' refreshes), and each opened
store's lookups by outcome, read from the SDK's `Store.stats` at each scrape (`watch_stores`): a lookup that outran
its timeout drafted nothing that step, which the other figures cannot tell from a store that had no tree.

One `ServerMetrics` per server, on its own `CollectorRegistry` (so several servers in one process, as in the
tests, never clash); `GET /metrics` renders it in the Prometheus text format.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

CONTENT_TYPE = CONTENT_TYPE_LATEST

StoreStats = Callable[[], Mapping[str, Mapping[str, int]]]  # store name -> the SDK's Store.stats

# (Store.stats key, metric, help): contexts, cache hits, lookup calls past their timeout, failed lookup calls
STORE_COUNTERS = (
    ("lookups", "crest_store_lookups", "Contexts looked up in the store"),
    ("hits", "crest_store_cache_hits", "Contexts answered by the SDK's cache, without the database"),
    ("timeouts", "crest_store_lookup_timeouts", "Lookups past their timeout (CREST_LOOKUP_TIMEOUT): no store draft"),
    ("errors", "crest_store_lookup_errors", "Lookups that failed (database errors, corrupt trees): no store draft"),
)


class _StoreCounters(Collector):
    """Each opened store's lookup counters, read from its `Store.stats` when scraped."""

    def __init__(self, read: StoreStats) -> None:
        self.read = read

    def collect(self) -> Iterator[Metric]:
        stats = self.read()
        for key, name, text in STORE_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["store"])
            for store in sorted(stats):
                family.add_metric([store], float(stats[store].get(key, 0)))
            yield family


class ServerMetrics:
    """The server's counters, gauges and histograms; the scheduler reports into it from its thread."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "crest_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("crest_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.completion_tokens = Counter("crest_completion_tokens", "Generated tokens of finished requests", registry=r)
        self.draft_tokens = Counter("crest_draft_tokens", "Verified draft tokens by result", ["result"], registry=r)
        self.accepted_per_step = Histogram(
            "crest_accepted_tokens_per_step",
            "Draft tokens accepted per row per step",
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=r,
        )
        self.draft_seconds = Histogram(
            "crest_draft_seconds",
            "Seconds spent drafting for a whole batch per step",
            buckets=(0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5),
            registry=r,
        )
        self.queue_depth = Gauge("crest_queue_depth", "Requests waiting for a batch row", registry=r)
        self.batch_size = Gauge("crest_batch_size", "Rows in the batch", registry=r)
        self.steps = Counter("crest_steps", "Batched decoding steps (one target forward each)", registry=r)
        self.learned_tokens = Counter(
            "crest_learned_tokens", "Served tokens written to the stores' learned logs", registry=r
        )
        self.learn_dropped_tokens = Counter(
            "crest_learn_dropped_tokens", "Served tokens not learned (queue full or database failing)", registry=r
        )
        self.live_refreshes = Counter("crest_live_refresh", "Live-tier refreshes by result", ["result"], registry=r)
        self._stores: _StoreCounters | None = None  # the opened stores' lookup counters (`watch_stores`)
        for result in ("published", "nothing", "busy", "failed"):
            self.live_refreshes.labels(result)

    def observe_step(self, *, rows: int, accepted: list[int], draft_seconds: float) -> None:
        """Record one batched step."""
        self.steps.inc()
        self.batch_size.set(rows)
        self.draft_seconds.observe(draft_seconds)
        for n in accepted:
            self.accepted_per_step.observe(n)

    def observe_done(self, outcome: Any) -> None:
        """Record a finished request's tokens."""
        result = outcome.result
        self.prompt_tokens.inc(len(result.prompt_token_ids))
        self.completion_tokens.inc(result.new_tokens)
        self.draft_tokens.labels("accepted").inc(outcome.accepted_draft_tokens)
        self.draft_tokens.labels("rejected").inc(outcome.rejected_draft_tokens)

    def observe_queue(self, *, queued: int, active: int) -> None:
        """Record the queue depth and batch size between steps."""
        self.queue_depth.set(queued)
        self.batch_size.set(active)

    def observe_learned(self, rows: int, tokens: int) -> None:
        """Record tokens a store's learner wrote."""
        self.learned_tokens.inc(tokens)

    def observe_learn_dropped(self, rows: int, tokens: int) -> None:
        """Record tokens a store's learner dropped."""
        self.learn_dropped_tokens.inc(tokens)

    def observe_refresh(self, result: str) -> None:
        """Record one live-tier refresh: published, nothing or failed."""
        self.live_refreshes.labels(result).inc()

    def count_request(self, endpoint: str, status: int) -> None:
        """Count one HTTP request."""
        self.requests.labels(endpoint, str(status)).inc()

    def watch_stores(self, read: StoreStats) -> None:
        """Report the lookup counters `read` returns (store name -> `Store.stats`) at every scrape (the last given)."""
        if self._stores is None:
            self._stores = _StoreCounters(read)
            self.registry.register(self._stores)
        self._stores.read = read

    def render(self) -> bytes:
        """Return the metrics in the Prometheus text format."""
        return bytes(generate_latest(self.registry))
