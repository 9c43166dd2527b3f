"""Offline throughput and latency through kiln's own engine (the API a user drives)."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from kiln.bench.metrics import RequestTiming
from kiln.bench.workload import BenchRequest
from kiln.engine.llm_engine import LLMEngine
from kiln.lora.request import LoRARequest
from kiln.sampling_params import SamplingParams


def run_kiln(
    engine: LLMEngine,
    requests: list[BenchRequest],
    concurrency: int | None = None,
    progress: bool = True,
    step_clock: dict | None = None,
    loras: list[LoRARequest] | None = None,
) -> list[RequestTiming]:
    """Submit every request at t=0 (or keep `concurrency` in flight), EOS ignored; record the
    wall time of every generated token. With `loras`, request i runs adapter i mod len(loras)."""
    timings: dict[str, RequestTiming] = {}
    pending = list(enumerate(requests))
    pending.reverse()
    in_flight = 0
    limit = concurrency or len(requests)
    bar = tqdm(total=len(requests), desc="kiln", disable=not progress)

    def submit() -> None:
        nonlocal in_flight
        while pending and in_flight < limit:
            index, req = pending.pop()
            params = SamplingParams(
                temperature=0, max_tokens=req.output_len, min_tokens=0, ignore_eos=True
            )
            req_id = f"bench-{index}"
            timings[req_id] = RequestTiming(time.perf_counter(), [], len(req.prompt_token_ids))
            lora = loras[index % len(loras)] if loras else None
            engine.add_request(req.prompt_token_ids, params, request_id=req_id, lora_request=lora)
            in_flight += 1

    submit()
    step_timing = engine.executor.stats().step_timing
    trace = step_timing.setdefault("trace", []) if step_timing is not None else []
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        num_traced = len(trace)
        deltas = engine.step()
        now = time.perf_counter()
        if step_clock is not None:
            _clock_step(step_clock, trace[num_traced:], now - before)
        for delta in deltas:
            timing = timings[delta.request_id]
            for completion in delta.outputs:  # (once per running request a step: kept lean)
                timing.token_times += [now] * len(completion.token_ids)
                if completion.num_spec_steps:
                    timing.num_draft_tokens += completion.num_draft_tokens
                    timing.num_accepted_tokens += completion.num_accepted_tokens
                    timing.num_spec_steps += completion.num_spec_steps
            if delta.finished:
                engine.finished_output(delta.request_id)
                in_flight -= 1
                bar.update(1)
        submit()
    bar.close()
    return [timings[f"bench-{i}"] for i in range(len(requests))]


def _clock_step(step_clock: dict, new_rows: list, wall: float) -> None:
    """The whole engine.step() wall time, for the host-time profile, counted against the runner
    step it collected (trace rows are written at collection). With async scheduling a call
    collects the previous step, and the first call of a run collects none: its few ms of
    scheduling and launching are not counted. A call that drains two steps counts once."""
    if not new_rows:
        return
    kind = "graph_" if new_rows[-1][0] else "eager_"
    for key, value in (("wall", wall), ("steps", 1)):
        step_clock[key] = step_clock.get(key, 0.0) + value
        step_clock[kind + key] = step_clock.get(kind + key, 0.0) + value
    walls = step_clock.setdefault("walls", [])
    walls += [round(wall * 1000, 3)] + [0.0] * (len(new_rows) - 1)
