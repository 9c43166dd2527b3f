"""Prometheus metrics with vLLM's names, types, labels and buckets, so vLLM's dashboards work.

Each metric is defined once, unprefixed, in a private registry; /metrics renders that registry
under the chosen prefix(es): `kiln:` (the default), `vllm:` (a vLLM Grafana dashboard works as it
is), or both. prometheus_client's process, platform and GC collectors come once, unprefixed, as
vLLM's do. Each app owns its registries, so several apps in one process (tests) do not collide.

Per-request latencies are observed in the server as deltas arrive (the same clock the client
sees, minus the network), per completion (each of a request's n counts, as in vLLM, where each
is a request of its own). Engine state (queue lengths, KV usage, prefix-cache and preemption
counters, tokens per step) is the engine's own snapshot as of its last step (StepLoop's,
refreshed at least every 0.1 s while it steps and whenever it goes idle): a scrape answers at once,
even during a long prefill, and never waits on the engine thread or process.

With several API processes (`kiln serve --api-server-count N`), each observes its own requests
into Prometheus's multiprocess files (`multiprocess_dir`: one file per process, summed at each
scrape), so any process's /metrics reports the whole server; the engine's snapshot reaches every
API process alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.utils import floatToGoString

from kiln.engine.scheduler import SpecDecodeStats
from kiln.engine.step_loop import EngineSnapshot
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

if TYPE_CHECKING:  # state.py imports this module
    from kiln.server.state import ServedEngine

# `--metrics-prefix` choices -> the prefixes every metric is rendered under.
PREFIXES: dict[str, tuple[str, ...]] = {
    "kiln": ("kiln",),
    "vllm": ("vllm",),
    "both": ("kiln", "vllm"),
}

# vLLM's buckets, so quantiles computed from either server line up.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
_ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_N_BUCKETS = (1, 2, 5, 10, 20)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max(max_value, 1):
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _EngineCollector:
    def __init__(self, labels: dict[str, str], cache_info: dict[str, str]) -> None:
        self.labels = labels
        self.cache_info = cache_info
        self.snapshot = EngineSnapshot()
        self.adapters: list[str] | None = None  # the LoRA adapters served; None: LoRA is off
        self.max_loras = 0

    def collect(self) -> Iterator[Metric]:
        s, names, values = self.snapshot, list(self.labels), list(self.labels.values())
        info = GaugeMetricFamily(
            "cache_config_info", "The KV cache as built.", labels=list(self.cache_info)
        )
        info.add_metric(list(self.cache_info.values()), 1)  # an info metric: labels are the data
        yield info

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        # vLLM V0's panels: kiln never swaps (preemption recomputes) and has no CPU KV tier.
        yield gauge("num_requests_swapped", "Sequences swapped to CPU (kiln: always 0).", 0)
        yield gauge("cpu_cache_usage_perc", "CPU KV cache usage (kiln: always 0).", 0.0)
        yield gauge("kv_cache_usage_perc", "KV cache usage (1 = full).", s.kv_cache_usage)
        # vLLM's older name, still on its dashboard.
        yield gauge(
            "gpu_cache_usage_perc", "KV cache usage (= kv_cache_usage_perc).", s.kv_cache_usage
        )
        hit_rate = s.prefix_hits / s.prefix_queries if s.prefix_queries else 0.0
        yield gauge("prefix_cache_hit_rate", "Prefix-cache hits / queries, tokens.", hit_rate)
        yield counter("prefix_cache_queries", "Prompt tokens looked up.", s.prefix_queries)
        yield counter("prefix_cache_hits", "Prompt tokens served from the cache.", s.prefix_hits)
        yield counter("num_preemptions", "Preemptions (recompute).", s.num_preemptions)
        yield self._iteration_tokens(names, values)
        if s.spec_decode is not None:
            yield from self._spec_decode(s.spec_decode, counter, names, values)
        if self.adapters is not None:
            lora = GaugeMetricFamily(
                "lora_adapters_info",
                "LoRA adapters served (value: how many; labels: their names, comma-separated, "
                "and the GPU slots, --max-loras).",
                labels=[*names, "adapters", "max_lora"],
            )
            lora.add_metric(
                [*values, ",".join(self.adapters), str(self.max_loras)], len(self.adapters)
            )
            yield lora
            # vLLM's: the adapters of running and waiting requests as labels, the value a time.
            requests = GaugeMetricFamily(
                "lora_requests_info",
                "LoRA adapters of the running and waiting requests (labels); value: when.",
                labels=["running_lora_adapters", "waiting_lora_adapters", "max_lora"],
            )
            labels = [",".join(s.running_loras), ",".join(s.waiting_loras), str(self.max_loras)]
            requests.add_metric(labels, time.time())
            yield requests

    @staticmethod
    def _spec_decode(sd: SpecDecodeStats, counter, names: list[str], values: list[str]):
        """vLLM's spec_decode_* counters: acceptance rate = accepted / draft tokens, mean
        acceptance length = 1 + accepted / drafts."""
        yield counter("spec_decode_num_drafts", "Verification steps (per request).", sd.num_drafts)
        yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.", sd.num_draft_tokens)
        yield counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted.", sd.num_accepted_tokens
        )
        per_pos = CounterMetricFamily(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft.",
            labels=[*names, "position"],
        )
        for pos, count in enumerate(sd.accepted_per_pos):
            per_pos.add_metric([*values, str(pos)], count)
        yield per_pos

    def _iteration_tokens(self, names: list[str], values: list[str]) -> HistogramMetricFamily:
        # Rendered from the loop's exact counts (one per distinct step size): nothing is lost
        # between scrapes, however many steps ran.
        counts = self.snapshot.iteration_tokens
        h = HistogramMetricFamily("iteration_tokens_total", "Tokens per engine step.", labels=names)
        buckets = [
            (floatToGoString(le), sum(c for size, c in counts.items() if size <= le))
            for le in _ITERATION_BUCKETS
        ]
        buckets.append(("+Inf", sum(counts.values())))
        h.add_metric(values, buckets, sum(size * c for size, c in counts.items()))
        return h


# Families rendered a second time under another name: (name, documentation). vLLM's older
# time_per_output_token_seconds is the same observation as inter_token_latency_seconds, so it is
# observed once (a histogram observation per streamed token is the server's hot path).
_ALIASES = {
    "inter_token_latency_seconds": (
        "time_per_output_token_seconds",
        "Inter-token latency (older name).",
    ),
}


class _Prefixed:
    """Every family of `source` (and its alias), renamed `<prefix>:<name>` once per prefix."""

    def __init__(self, source: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.source = source
        self.prefixes = prefixes

    def collect(self) -> Iterator[Metric]:
        families = []
        for family in self.source.collect():
            families.append((family.name, family.documentation, family))
            if family.name in _ALIASES:
                families.append((*_ALIASES[family.name], family))
        for prefix in self.prefixes:
            for name, doc, family in families:
                renamed = Metric(f"{prefix}:{name}", doc, family.type, family.unit)
                renamed.samples = [
                    s._replace(name=f"{prefix}:{name}{s.name[len(family.name) :]}")
                    for s in family.samples
                ]
                yield renamed


class ServerMetrics:
    def __init__(
        self,
        model_name: str,
        max_model_len: int,
        cache_info: dict[str, str],
        prefix: str = "kiln",
        multiprocess_dir: str | None = None,
    ) -> None:
        """`multiprocess_dir`: this server's Prometheus multiprocess directory when it runs
        several API processes (their values are summed from it); None: this process's own."""
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {sorted(PREFIXES)}, got {prefix!r}")
        self.max_model_len = max_model_len
        source = CollectorRegistry()  # the definitions, unprefixed
        labels = {"model_name": model_name}
        self._labels = labels
        names = list(labels)
        tokens = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            h = Histogram(name, doc, names, registry=source, buckets=buckets)
            return h.labels(**labels)

        def count(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=source).labels(**labels)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency.", _ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", _REQUEST_BUCKETS)
        self.queue = hist(
            "request_queue_time_seconds", "Arrival to first scheduled.", _REQUEST_BUCKETS
        )
        self.prefill = hist(
            "request_prefill_time_seconds", "First scheduled to first token.", _REQUEST_BUCKETS
        )
        self.decode = hist(
            "request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS
        )
        self.inference = hist(
            "request_inference_time_seconds", "First scheduled to last token.", _REQUEST_BUCKETS
        )
        self.request_prompt_tokens = hist(
            "request_prompt_tokens", "Prompt tokens of each finished request.", tokens
        )
        self.request_generation_tokens = hist(
            "request_generation_tokens", "Tokens generated by each finished request.", tokens
        )
        self.max_generation_tokens = hist(
            "request_max_num_generation_tokens",
            "Most tokens generated by one of a request's n completions.",
            tokens,
        )
        self.params_n = hist("request_params_n", "The n request parameter.", _N_BUCKETS)
        self.params_max_tokens = hist(
            "request_params_max_tokens", "The max_tokens request parameter.", tokens
        )
        self.prompt_tokens = count("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = count("generation_tokens", "Tokens generated.")
        self._success = Counter(
            "request_success",
            "Finished completions by finish reason (abort: the client left, or the drain).",
            [*names, "finished_reason"],
            registry=source,
        )
        self._engine = _EngineCollector(labels, cache_info)
        if multiprocess_dir is not None:
            if not values.ValueClass._multiprocess:
                raise RuntimeError(
                    "multiprocess metrics need PROMETHEUS_MULTIPROC_DIR set before "
                    "prometheus_client is imported"
                )
            source = CollectorRegistry()  # every API process's values, summed per scrape
            MultiProcessCollector(source, path=multiprocess_dir)
        source.register(self._engine)

        self.registry = CollectorRegistry()  # what /metrics serves
        self.registry.register(_Prefixed(source, PREFIXES[prefix]))
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)  # registers nothing off CPython

    def admitted(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """An engine request the server accepted (one prompt, its n completions)."""
        self.prompt_tokens.inc(num_prompt_tokens)
        self.params_n.observe(params.n)
        max_tokens = params.max_tokens
        if max_tokens is None:  # up to the context: what vLLM's server would have filled in
            max_tokens = max(1, self.max_model_len - num_prompt_tokens)
        self.params_max_tokens.observe(max_tokens)

    def set_adapters(self, names: list[str], max_loras: int | None = None) -> None:
        """The LoRA adapters this server serves now (`lora_adapters_info`)."""
        self._engine.adapters = list(names)
        if max_loras is not None:
            self._engine.max_loras = max_loras

    def finished(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def observe_itl(self, seconds: float) -> None:
        self.itl.observe(seconds)  # rendered as time_per_output_token_seconds too

    async def render(self, engine: ServedEngine) -> bytes:
        """Render with the engine's last-step snapshot (`engine.stats`, an AsyncEngine or an
        EngineClient): no round trip to the engine, so a long step cannot delay the scrape."""
        self._engine.snapshot = engine.stats
        return generate_latest(self.registry)


@dataclass
class _Completion:
    first: float | None = None  # when its first token arrived
    last: float | None = None  # when its latest token arrived
    num_tokens: int = 0
    done: bool = False


class RequestTimer:
    """One engine request's timestamps, per completion: observes TTFT and ITL as tokens arrive,
    and the per-request histograms and request_success as each completion finishes."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int, n: int = 1) -> None:
        self.metrics = metrics
        self.num_prompt_tokens = num_prompt_tokens
        self.arrival = time.monotonic()
        self.scheduled: float | None = None
        self.completions = [_Completion() for _ in range(n)]

    def on_delta(self, delta: RequestOutput) -> None:
        now = time.monotonic()
        m = self.metrics
        scheduled = delta.metrics.get("first_scheduled_time")
        if scheduled is not None and self.scheduled is None:
            self.scheduled = max(self.arrival, scheduled)
        for o in delta.outputs:
            c = self.completions[o.index]
            if o.token_ids:
                if c.first is None:
                    c.first = now
                    m.ttft.observe(now - self.arrival)
                else:
                    m.observe_itl(now - (c.last or now))
                c.last = now
                c.num_tokens += len(o.token_ids)
                m.generation_tokens.inc(len(o.token_ids))
            if o.finish_reason is not None and not c.done:
                self._finish(c, o.finish_reason, now)
                if all(c.done for c in self.completions):
                    m.max_generation_tokens.observe(max(c.num_tokens for c in self.completions))

    def _finish(self, c: _Completion, reason: str, now: float) -> None:
        c.done = True
        m = self.metrics
        m.finished(reason)
        scheduled = self.scheduled if self.scheduled is not None else now  # never scheduled
        first = c.first if c.first is not None else now  # no token (an abort mid-prefill)
        last = c.last if c.last is not None else now
        m.e2e.observe(now - self.arrival)
        m.queue.observe(scheduled - self.arrival)
        m.prefill.observe(max(0.0, first - scheduled))
        m.decode.observe(max(0.0, last - first))
        m.inference.observe(max(0.0, last - scheduled))
        m.request_prompt_tokens.observe(self.num_prompt_tokens)
        m.request_generation_tokens.observe(c.num_tokens)

    def abandon(self) -> None:
        """The client went away: its unfinished completions count as aborted. Only in
        request_success: nobody received a last token to time."""
        for c in self.completions:
            if not c.done:
                c.done = True
                self.metrics.finished("abort")
