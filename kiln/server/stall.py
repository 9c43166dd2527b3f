"""Whether the engine still makes progress: an engine that holds work and has made no step for
`timeout_s` is stalled (a hung kernel, a deadlocked collective), and /health and KServe's ready
say 503 with the reason while the liveness of its loop alone would still say 200.

The evidence is the engine's last-step snapshot (`engine.stats`), which a stepping engine renews
every SNAPSHOT_PERIOD_S and an idle one once on going idle: a snapshot that shows requests and
is older than the timeout means no step has finished since. A request sent to an idle engine
that wedges on its first step leaves an idle snapshot behind in an in-process engine (the engine
process sends one showing the work before that step, to every API process); the server's own
waiting requests (no token yet) count as work then, timed from when the watch first saw them."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from kiln.server.lifecycle import Lifecycle
from kiln.server.metrics import PREFIXES, _Prefixed
from kiln.server.serving import DEFAULT_STALL_TIMEOUT_S
from kiln.server.state import ServedEngine


class StallWatch:
    def __init__(
        self,
        engine: ServedEngine,
        lifecycle: Lifecycle,
        timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`timeout_s`: None or 0 turns the watch off (never stalled)."""
        if timeout_s is not None and timeout_s < 0:
            raise ValueError(f"the stall timeout must be >= 0 seconds, got {timeout_s}")
        self.engine = engine
        self.lifecycle = lifecycle
        self.timeout_s = timeout_s or None
        self.clock = clock
        self._idle_seen: tuple[float, float] | None = None  # (snapshot time, first seen at)

    def quiet_seconds(self) -> float:
        """Seconds the engine has held work without finishing a step (0 without work)."""
        snapshot = self.engine.stats
        now = self.clock()
        if snapshot.num_running + snapshot.num_waiting > 0:
            self._idle_seen = None
            return max(0.0, now - snapshot.time)
        if self.lifecycle.num_waiting <= 0:
            self._idle_seen = None
            return 0.0
        if self._idle_seen is None or self._idle_seen[0] != snapshot.time:
            self._idle_seen = (snapshot.time, now)
        return now - self._idle_seen[1]

    def reason(self) -> str | None:
        """Why the engine counts as stalled, or None."""
        if self.timeout_s is None or not self.engine.healthy:
            return None
        quiet = self.quiet_seconds()
        if quiet <= self.timeout_s:
            return None
        snapshot = self.engine.stats
        return (
            f"the engine has made no step for {quiet:.1f} s (limit {self.timeout_s:g} s) with "
            f"{snapshot.num_running} running and {snapshot.num_waiting} waiting requests "
            f"({self.lifecycle.num_waiting} waiting on this server)"
        )

    def collect(self) -> Iterator[GaugeMetricFamily]:
        quiet = self.quiet_seconds()
        stalled = self.timeout_s is not None and quiet > self.timeout_s
        yield GaugeMetricFamily(
            "engine_seconds_since_step",
            "Seconds the engine has held work without finishing a step (0 without work).",
            value=quiet,
        )
        yield GaugeMetricFamily(
            "engine_stalled",
            "1 while the engine holds work and has made no step for the stall timeout.",
            value=float(stalled),
        )

    def register(self, registry: CollectorRegistry, prefix: str) -> None:
        """Serve the watch's gauges on /metrics, named as the server's other metrics."""
        source = CollectorRegistry()
        source.register(self)
        registry.register(_Prefixed(source, PREFIXES[prefix]))
