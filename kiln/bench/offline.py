"""Offline throughput and latency through kiln's own engine (the API a user drives)."""

from __future__ import annotations

import time

from tqdm.auto import tqdm

from kiln.bench.metrics import RequestTiming
from kiln.bench.workload import BenchRequest
from kiln.engine.llm_engine import LLMEngine
from kiln.sampling_params import SamplingParams


def run_kiln(
    engine: LLMEngine,
    requests: list[BenchRequest],
    concurrency: int | None = None,
    progress: bool = True,
    step_clock: dict | None = None,
) -> list[RequestTiming]:
    """Submit every request at t=0 (or keep `concurrency` in flight), EOS ignored; record the
    wall time of every generated token."""
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
            engine.add_request(req.prompt_token_ids, params, request_id=req_id)
            in_flight += 1

    submit()
    while engine.has_unfinished_requests():
        before = time.perf_counter()
        deltas = engine.step()
        now = time.perf_counter()
        if step_clock is not None:  # the whole engine step, for the host-time profile
            kind = "graph_" if engine.runner.last_step_used_graph else "eager_"
            for key, value in (("wall", now - before), ("steps", 1)):
                step_clock[key] = step_clock.get(key, 0.0) + value
                step_clock[kind + key] = step_clock.get(kind + key, 0.0) + value
            step_clock.setdefault("walls", []).append(round((now - before) * 1000, 3))
        for delta in deltas:
            timing = timings[delta.request_id]
            for completion in delta.outputs:
                timing.token_times.extend([now] * len(completion.token_ids))
            if delta.finished:
                engine.finished_output(delta.request_id)
                in_flight -= 1
                bar.update(1)
        submit()
    bar.close()
    return [timings[f"bench-{i}"] for i in range(len(requests))]
