"""Prometheus metrics named after vLLM's (`vllm:` -> `kiln:`), so existing dashboards carry over.

Per-request latencies are observed in the server as deltas arrive (the same clock the client
sees, minus the network). Engine state (queue lengths, KV usage, prefix-cache and preemption
counters) is read on the engine's loop thread at scrape time, never from the event loop's side.
Each app owns its registry, so several apps in one process (tests) do not collide.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.outputs import RequestOutput

# vLLM's buckets, so quantiles computed from either server line up.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class EngineSnapshot:
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0


def read_engine(engine: LLMEngine) -> EngineSnapshot:
    """Runs on the engine loop thread (via AsyncEngine.call): the scheduler is not shared."""
    stats = engine.kv_cache.stats
    return EngineSnapshot(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        kv_cache_usage=engine.kv_cache_usage,
        prefix_queries=stats.queries,
        prefix_hits=stats.hits,
        num_preemptions=engine.scheduler.num_preemptions_total,
    )


class _EngineCollector:
    def __init__(self, labels: dict[str, str]) -> None:
        self.labels = labels
        self.snapshot = EngineSnapshot()

    def collect(self) -> Iterator:
        s, names, values = self.snapshot, list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"kiln:{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"kiln:{name}", doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("kv_cache_usage_perc", "KV cache usage (1 = full).", s.kv_cache_usage)
        hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries, tokens.", hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up.", s.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the cache.", s.prefix_hits)
        yield counter("num_preemptions", "Preemptions (recompute).", s.num_preemptions)


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self._labels = labels
        names = list(labels)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            h = Histogram(f"kiln:{name}", doc, names, registry=self.registry, buckets=buckets)
            return h.labels(**labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "End-to-end request latency.", _E2E_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Arrival to first scheduled.", _E2E_BUCKETS)
        self.prompt_tokens = Counter(
            "kiln:prompt_tokens", "Prompt tokens processed.", names, registry=self.registry
        ).labels(**labels)
        self.generation_tokens = Counter(
            "kiln:generation_tokens", "Tokens generated.", names, registry=self.registry
        ).labels(**labels)
        self._success = Counter(
            "kiln:request_success",
            "Finished completions by finish reason.",
            [*names, "finished_reason"],
            registry=self.registry,
        )
        self._engine = _EngineCollector(labels)
        self.registry.register(self._engine)

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    async def render(self, engine: AsyncEngine) -> bytes:
        """Refresh the engine snapshot (a stale one if the engine is dead or busy) and render."""
        if engine.healthy:
            # A dead or stuck engine must not break the scrape: keep the last snapshot.
            with contextlib.suppress(Exception):
                self._engine.snapshot = await asyncio.wait_for(engine.call(read_engine), 5.0)
        return generate_latest(self.registry)


class RequestTimer:
    """One engine request's timestamps; observes TTFT, ITL, queue time and E2E as it goes."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.monotonic()
        self.last: float | None = None

    def on_delta(self, delta: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        num_new = sum(len(o.token_ids) for o in delta.outputs)
        scheduled = delta.metrics.get("first_scheduled_time")
        if scheduled is not None:
            m.queue.observe(max(0.0, scheduled - self.arrival))
        if num_new:
            if self.last is None:
                m.ttft.observe(now - self.arrival)
            else:
                m.itl.observe(now - self.last)
            self.last = now
            m.generation_tokens.inc(num_new)
        for o in delta.outputs:
            if o.finish_reason is not None:
                m.finished(o.finish_reason)
        if delta.finished:
            m.e2e.observe(now - self.arrival)
