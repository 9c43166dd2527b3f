"""The engine's books around `LLMEngine.step()`, shared by the engine thread (AsyncEngine) and the
engine process (kiln.engine_core): when each request was first scheduled, tokens per step, the
last-step snapshot /metrics serves, and `stream_interval` (deltas of a request merged until it
has N new tokens; the first token and the last delta go out at once, as vLLM's
`--stream-interval`). No threads, no I/O: the driver decides where deltas go.

Each request's first delta carries `metrics["first_scheduled_time"]` (time.monotonic() at the
start of the step that first scheduled it): the end of its queue time, which the server reports.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from dataclasses import dataclass, field

from kiln.engine.llm_engine import LLMEngine
from kiln.engine.scheduler import SpecDecodeStats
from kiln.lora.request import LoRARequest
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

SNAPSHOT_PERIOD_S = 0.1  # how stale /metrics may be while the engine steps


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine as of a step: what /metrics reports, read without waiting for the engine."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    num_preemptions: int = 0
    iteration_tokens: dict[int, int] = field(default_factory=dict)  # tokens in a step -> steps
    time: float = 0.0  # time.monotonic() of the step it describes
    spec_decode: SpecDecodeStats | None = None  # None: speculative decoding is off
    # The LoRA adapters of running / waiting requests, by name (vLLM's lora_requests_info).
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()


def read_snapshot(
    engine: LLMEngine, iteration_tokens: dict[int, int], now: float
) -> EngineSnapshot:
    """The engine's gauges and counters now (on the thread that runs its steps)."""
    stats = engine.kv_cache.stats
    scheduler = engine.scheduler
    return EngineSnapshot(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting) + engine.num_held,
        kv_cache_usage=engine.kv_cache_usage,
        prefix_queries=stats.queries,
        prefix_hits=stats.hits,
        num_preemptions=scheduler.num_preemptions_total,
        iteration_tokens=dict(iteration_tokens),
        time=now,
        **_lora_names(engine),
        spec_decode=None
        if scheduler.num_spec_tokens is None
        else dataclasses.replace(
            scheduler.spec_stats, accepted_per_pos=list(scheduler.spec_stats.accepted_per_pos)
        ),
    )


def _lora_names(engine: LLMEngine) -> dict[str, tuple[str, ...]]:
    """The adapters the running and the waiting requests use (empty without enable_lora)."""
    if not engine.config.enable_lora:
        return {}
    names = {i: lora.request.lora_name for i, lora in engine.loras.loras.items()}

    def of(requests) -> tuple[str, ...]:
        ids = {r.lora_int_id for r in requests if r.lora_int_id is not None}
        return tuple(sorted(names[i] for i in ids if i in names))

    scheduler = engine.scheduler
    return {"running_loras": of(scheduler.running), "waiting_loras": of(scheduler.waiting)}


@dataclass(frozen=True)
class EngineInfo:
    """Facts of a running engine, fixed once it is built (safe to read from any thread)."""

    max_model_len: int
    vocab_size: int
    default_params: SamplingParams
    cache_config: dict[str, str]  # vLLM's cache_config_info labels


def engine_info(engine: LLMEngine) -> EngineInfo:
    kv = engine.kv_cache
    return EngineInfo(
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
        default_params=engine.default_sampling_params(),
        cache_config={
            "block_size": str(kv.block_size),
            "num_gpu_blocks": str(kv.pool.num_blocks),
            "cache_dtype": str(engine.kv_cache_dtype),
            "enable_prefix_caching": str(kv.pool.enable_caching),
        },
    )


class StepLoop:
    """Add, abort and step one LLMEngine, returning the deltas to deliver. One thread only."""

    def __init__(self, engine: LLMEngine, stream_interval: int = 1) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.engine = engine
        self.stream_interval = stream_interval
        self._unscheduled: set[str] = set()
        self._scheduled_at: dict[str, float] = {}
        self._pending: dict[str, RequestOutput] = {}  # merged deltas not yet sent
        self._sent_first: set[str] = set()
        # Tokens in a step -> how many steps had that many: exact and bounded (one key per size).
        self.iteration_tokens: Counter[int] = Counter()
        self.snapshot = EngineSnapshot()
        self._snapshot_due = 0.0

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add(
        self,
        req_id: str,
        prompt,
        params: SamplingParams | None,
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request; raises InvalidRequestError (LoRAError too) for invalid input."""
        self.engine.add_request(
            prompt, params, request_id=req_id, priority=priority, lora_request=lora_request
        )
        self._unscheduled.add(req_id)

    def abort(self, req_id: str) -> list[RequestOutput]:
        """Abort in the engine. Returns what a still-listening stream must get: its merged
        pending delta and a last delta with finish_reason "abort" (a server-side abort, e.g. the
        drain deadline, must not leave a stream waiting forever)."""
        self._unscheduled.discard(req_id)
        self._scheduled_at.pop(req_id, None)
        self._sent_first.discard(req_id)
        out: list[RequestOutput] = []
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            out.append(pending)
        for final in self.engine.abort_request(req_id):
            ended = [
                CompletionOutput(o.index, "", [], None, o.finish_reason, o.stop_reason)
                for o in final.outputs
                if o.finish_reason == "abort"
            ]
            out.append(
                RequestOutput(
                    final.request_id, final.prompt, final.prompt_token_ids, ended, finished=True
                )
            )
        return out

    def step(self) -> list[RequestOutput]:
        """One engine step; the deltas due now (all of them with stream_interval 1)."""
        step_start = time.monotonic()
        was_idle = self.snapshot.num_running + self.snapshot.num_waiting == 0
        deltas = self.engine.step()
        self._stamp_scheduled(step_start)
        self._count_iteration_tokens(deltas)
        due: list[RequestOutput] = []
        for delta in deltas:
            if delta.finished:
                self.engine.finished_output(delta.request_id)
            scheduled = self._scheduled_at.pop(delta.request_id, None)
            if scheduled is not None:
                delta.metrics["first_scheduled_time"] = scheduled
            ready = self._coalesce(delta)
            if ready is not None:
                due.append(ready)
        # Out of idle, now: a wedge within the snapshot period must still show as held work.
        self.refresh_snapshot(force=was_idle)
        return due

    def refresh_snapshot(self, force: bool) -> bool:
        """Re-read the engine's gauges at most every SNAPSHOT_PERIOD_S (or now); True if new."""
        now = time.monotonic()
        if not force and now < self._snapshot_due:
            return False
        self._snapshot_due = now + SNAPSHOT_PERIOD_S
        self.snapshot = read_snapshot(self.engine, self.iteration_tokens, now)
        return True

    # ---- books ---------------------------------------------------------------------------

    def _coalesce(self, delta: RequestOutput) -> RequestOutput | None:
        req_id = delta.request_id
        if delta.finished:
            self._unscheduled.discard(req_id)
            self._sent_first.discard(req_id)
        if self.stream_interval == 1:
            return delta
        pending = self._pending.pop(req_id, None)
        merged = delta if pending is None else merge_deltas(pending, delta)
        first = req_id not in self._sent_first and any(o.token_ids for o in merged.outputs)
        most = max((len(o.token_ids) for o in merged.outputs), default=0)
        if merged.finished or first or most >= self.stream_interval:
            if not merged.finished and any(o.token_ids for o in merged.outputs):
                self._sent_first.add(req_id)
            return merged
        self._pending[req_id] = merged
        return None

    def _stamp_scheduled(self, step_start: float) -> None:
        """Requests no longer waiting after this step were first scheduled at its start."""
        if not self._unscheduled:
            return
        waiting = {r.req_id for r in self.engine.scheduler.waiting}
        for hook in self.engine.hooks:  # held out of the scheduler (compiling): not scheduled yet
            waiting |= hook.held_req_ids()
        for req_id in list(self._unscheduled):
            children = self.engine.output_processor.child_ids(req_id)
            if not any(child in waiting for child in children):
                self._unscheduled.discard(req_id)
                self._scheduled_at[req_id] = step_start

    def _count_iteration_tokens(self, deltas: list[RequestOutput]) -> None:
        """The step's tokens as vLLM's iteration_tokens_total counts them: every new token, plus
        a prompt's length in the step that gave a completion its first token."""
        total = 0
        for delta in deltas:
            state = self.engine.output_processor.requests.get(delta.request_id)
            for o in delta.outputs:
                total += len(o.token_ids)
                so_far = len(state.completions[o.index].output.token_ids) if state else 0
                if o.token_ids and so_far == len(o.token_ids):
                    total += len(delta.prompt_token_ids)
        if total:
            self.iteration_tokens[total] += 1


def merge_deltas(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One delta that says what `a` then `b` said (per completion: text and tokens appended)."""
    by_index = {o.index: o for o in a.outputs}
    for o in b.outputs:
        prev = by_index.get(o.index)
        if prev is None:
            by_index[o.index] = o
            continue
        logprobs = None
        if prev.logprobs is not None or o.logprobs is not None:
            logprobs = (prev.logprobs or []) + (o.logprobs or [])
        by_index[o.index] = CompletionOutput(
            o.index,
            prev.text + o.text,
            prev.token_ids + o.token_ids,
            logprobs,
            o.finish_reason,
            o.stop_reason,
            cumulative_logprob=o.cumulative_logprob,
            num_draft_tokens=prev.num_draft_tokens + o.num_draft_tokens,
            num_accepted_tokens=prev.num_accepted_tokens + o.num_accepted_tokens,
            num_spec_steps=prev.num_spec_steps + o.num_spec_steps,
            error=o.error,
        )
    return RequestOutput(
        a.request_id,
        a.prompt,
        a.prompt_token_ids,
        sorted(by_index.values(), key=lambda o: o.index),
        b.finished,
        a.prompt_logprobs if a.prompt_logprobs is not None else b.prompt_logprobs,
        max(a.num_cached_tokens, b.num_cached_tokens),
        {**b.metrics, **a.metrics},
    )
