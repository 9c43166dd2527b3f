"""Step timing: each step's host phases (and GPU time on CUDA), summed and traced per step.

`ModelRunner.step_timing = {}` installs a StepTimer that fills that dict: totals per phase in
seconds (all steps, and `graph_*` / `eager_*` by kind of step) and `trace`, one row of
TRACE_COLUMNS per step in ms. `kiln bench` reads them to split host time from device time.
"""

from __future__ import annotations

import torch

from kiln.runtime.in_flight import InFlightStep
from kiln.runtime.step_hooks.base import StepHook

# step_timing["trace"] rows; times in ms.
TRACE_COLUMNS = (
    "graph",
    "num_seqs",
    "num_tokens",
    "prepare",
    "forward_launch",
    "sample_launch",
    "sync_wait",
    "finish",
    "gpu",
)

GpuEvents = tuple[torch.cuda.Event, torch.cuda.Event]


class StepTimer(StepHook):
    """Records the runner's phase clock (InFlightStep.times) of every collected step into
    `totals`; on CUDA, the device time from the forward's launch to the sampler's."""

    def __init__(self, totals: dict, device: torch.device) -> None:
        self.totals = totals
        self._cuda = device.type == "cuda"
        self._events: dict[InFlightStep, GpuEvents] = {}

    def before_forward(self, step: InFlightStep) -> None:
        if self._cuda:
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
            self._events[step] = events

    def sampler_launched(self, step: InFlightStep) -> None:
        events = self._events.get(step)
        if events is not None:
            events[1].record()

    def collected(self, step: InFlightStep) -> None:
        events = self._events.pop(step, None)
        if step.sampled is None:  # no sampler ran (prompt chunks only): no end to time to
            events = None
        record_step(
            self.totals,
            step.times,
            events,
            step.graph,
            step.sched.total_num_scheduled_tokens,
            step.num_seqs,
        )


def record_step(
    totals: dict,
    times: tuple[float, ...],  # perf_counter at the phase boundaries (InFlightStep.times)
    gpu_events: GpuEvents | None,  # complete: the step's sync waited for the sampler
    graph: bool,
    num_tokens: int,
    num_seqs: int,
) -> None:
    # times: submit start, prepared, forward launched, sampling launched | collect start,
    # ids back, done. The gap between the two calls (the engine's own work) is not counted.
    t0, t1, t2, t3, t4, t5, t6 = times
    parts = {
        "prepare": t1 - t0,
        "forward_launch": t2 - t1,
        "sample_launch": t3 - t2,
        "sync_wait": t5 - t4,
        "finish": t6 - t5,
    }
    if gpu_events is not None:
        parts["gpu"] = gpu_events[0].elapsed_time(gpu_events[1]) / 1000
    row = [round(parts[n] * 1000, 3) if n in parts else None for n in TRACE_COLUMNS[3:]]
    totals.setdefault("trace", []).append([graph, num_seqs, num_tokens, *row])
    parts["steps"] = 1
    kind = "graph_" if graph else "eager_"
    for name, value in parts.items():  # totals, and per kind of step
        totals[name] = totals.get(name, 0.0) + value
        totals[kind + name] = totals.get(kind + name, 0.0) + value
