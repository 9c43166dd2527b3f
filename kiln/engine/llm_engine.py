"""The synchronous engine: add requests, step, abort. LLM and the async server loop drive it."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections import deque

from kiln.config import EngineConfig
from kiln.engine.beam_search import BeamSearchManager
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import EngineCoreOutput, Scheduler
from kiln.errors import InvalidRequestError
from kiln.executor import create_executor
from kiln.interfaces import BeamCandidates, ModelRunnerOutput, SchedulerOutput
from kiln.kv_cache.manager import KVCacheManager
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.structured_output.waitlist import GrammarWaitlist

logger = logging.getLogger("kiln")
# An engine with only compiling requests waits at most this long per step() for one to finish
# (then returns, so its driver can take in new requests).
GRAMMAR_WAIT_S = 0.01


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.executor = create_executor(config)
        facts = self.executor.facts
        self.model_config = facts.config
        self.tokenizer = facts.tokenizer
        self.generation_defaults = facts.generation_defaults
        self.model_description = facts.description
        self.device, self.dtype, self.kv_cache_dtype = (
            facts.device,
            facts.dtype,
            facts.kv_cache_dtype,
        )
        self.eos_token_ids = tuple(facts.config.eos_token_ids)
        self.memory_plan = self.executor.stats().memory_plan
        capacity = self.executor.kv_capacity()
        self.max_model_len = capacity.max_model_len
        self.kv_cache = KVCacheManager(
            capacity.num_blocks, capacity.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            num_spec_tokens=spec.num_tokens_for_batch if (spec := config.speculative) else None,
        )
        self.output_processor = OutputProcessor(self.tokenizer)
        self.beam_search = BeamSearchManager(self)  # above the scheduler: beams are requests
        # Requests whose grammar compiles in the background: out of the scheduler until ready.
        self.grammar_waitlist = GrammarWaitlist()
        self._ids = itertools.count()
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        # Speculative decoding: a step's drafts come from its own sampled tokens, and how many it
        # accepts decides where the next step starts, so the next step is scheduled only once
        # this one's tokens are back. What async scheduling overlaps instead is everything after
        # that: the previous step's outputs (detokenizing, stop strings, the caller's loop) are
        # made while the next step runs (_step_overlapping_outputs).
        self._overlap_outputs = spec is not None and self.async_scheduling
        # Steps submitted before the oldest is collected: two under async scheduling (the next
        # is scheduled and launched while one runs); under pipeline parallelism one per stage, in
        # micro-batches of different requests (the scheduler then schedules no request whose
        # token is in flight), so stage 0 runs step n+1 while the last stage runs step n.
        self.max_steps_in_flight = 1
        if self.async_scheduling and not self._overlap_outputs:
            self.max_steps_in_flight = max(2, config.pipeline_parallel_size)
        if self.async_scheduling and config.pipeline_parallel_size > 1:
            self.scheduler.num_micro_batches = config.pipeline_parallel_size
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted to the runner, uncollected
        self._failed_deltas: list[RequestOutput] = []  # compiles that failed: out of next step()
        # Startup objects (model, tokenizer, graphs) live as long as the engine: keep the cyclic
        # GC from walking them on every full collection while requests churn.
        gc.collect()
        gc.freeze()
        # Process-wide, like the freeze: the loop that drives step() (LLM.generate, the server,
        # kiln bench) allocates between steps too. Full collections come every 100 gen-0 ones.
        if config.gc_gen0_threshold:
            gc.set_threshold(config.gc_gen0_threshold, *gc.get_threshold()[1:])

    # ---- requests ----------------------------------------------------------------------------

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams from the model's generation_config.json, when a request gives none
        (like vLLM: its temperature/top_p/top_k/repetition_penalty/max_new_tokens; do_sample is
        not consulted)."""
        d = self.generation_defaults
        kwargs = {}
        for ours, theirs in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("top_k", "top_k"),
            ("repetition_penalty", "repetition_penalty"),
            ("max_tokens", "max_new_tokens"),
        ):
            if d.get(theirs) is not None:
                kwargs[ours] = d[theirs]
        return SamplingParams(**kwargs)

    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer: pass prompt_token_ids", param="prompt"
            )
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    def add_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
    ) -> str:
        """Validate and queue a request (a text prompt or token ids); returns its id."""
        params = params or self.default_sampling_params()
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.output_processor.requests or self.beam_search.owns(request_id):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt or [])
        self._validate(token_ids, params)
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        if params.use_beam_search:
            return self.beam_search.add(request_id, text, token_ids, params, max_tokens, priority)
        compiled = None
        if params.guided_decoding is not None:  # validated: its compile starts in the background
            compiled = self._grammar_compiler().compile_async(params.guided_decoding)
        child_ids = self.output_processor.add_request(request_id, text, token_ids, params)
        now = time.monotonic()
        for index, child_id in enumerate(child_ids):
            child_params = params
            if params.n > 1 and params.seed is not None:
                # Distinct but reproducible streams for each completion.
                child_params = _with_seed(params, params.seed + index)
            request = Request(
                child_id,
                token_ids,
                child_params,
                self.eos_token_ids,
                max_tokens,
                priority=priority,
                arrival_time=now,
            )
            if compiled is not None:  # even when done: a failed compile must not be scheduled
                self.grammar_waitlist.add(child_id, request, compiled)
            else:
                self.scheduler.add_request(request)
        self._admit_compiled()  # queues a grammar ready already; a failed compile ends it now
        return request_id

    def _grammar_compiler(self):  # -> kiln.structured_output.GrammarCompilerCache
        from kiln.structured_output import compiler_for

        return compiler_for(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the held requests whose grammar is ready (by arrival time: FCFS keeps their
        place) and finish those whose compile failed, with finish_reason "error"."""
        if not self.grammar_waitlist:
            return []
        ready, failed = self.grammar_waitlist.take_done()
        for request in ready:
            self.scheduler.add_request(request)
        if not failed:
            return []
        ended = [EngineCoreOutput(f.item.req_id, [], "error", error=f.error) for f in failed]
        deltas, _ = self.output_processor.process(ended)
        self._failed_deltas.extend(deltas)
        return deltas

    def _validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if len(token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {len(token_ids)} tokens, but this model's context holds "
                f"{self.max_model_len} (prompt plus at least one generated token)",
                param="prompt",
                code="context_length_exceeded",
            )
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt"
            )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # would index out of range when masked under min_tokens
            raise InvalidRequestError(
                f"stop token id {bad} is outside the vocabulary [0, {vocab})",
                param="stop_token_ids",
            )
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        if params.guided_decoding is not None:
            # Parse now (cheap; the compile runs in the background): a bad schema or grammar is
            # a 400 before queueing.
            if self.tokenizer is None:
                raise InvalidRequestError(
                    "structured output needs a tokenizer", param="guided_decoding"
                )
            if self.config.world_size > 1:  # the ranks' sampler applies no token bitmask yet
                raise InvalidRequestError(
                    "structured output is not supported with tensor or pipeline parallelism yet",
                    param="guided_decoding",
                )
            self._grammar_compiler().validate(params.guided_decoding)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests: their KV blocks are freed now. Returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for req_id in request_ids:
            beam_final = self.beam_search.abort(req_id)
            if beam_final is not None:
                finals.append(beam_final)
                continue
            children = self.output_processor.child_ids(req_id)
            for child in children:  # held while compiling: nothing allocated, just let go
                self.grammar_waitlist.abort(child)
            self.scheduler.finish_requests(children, RequestStatus.FINISHED_ABORTED)
            final = self.output_processor.abort(req_id)
            if final is not None:
                self.output_processor.pop(req_id)
                finals.append(final)
        self._drain_if_idle()
        return finals

    def has_unfinished_requests(self) -> bool:
        return (
            self.scheduler.has_unfinished_requests()
            or bool(self._in_flight)
            or self.beam_search.active
            or bool(self.grammar_waitlist)
            or bool(self._failed_deltas)
        )

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns delta outputs of the requests that progressed.

        A delta's completions carry only this step's new text, tokens and logprobs; the full
        output of a finished request is `finished_output(req_id)`.
        """
        self._admit_compiled()
        failed, self._failed_deltas = self._failed_deltas, []
        if (
            self.grammar_waitlist
            and not self._in_flight
            and not self.scheduler.has_unfinished_requests()
        ):
            # Only compiles to wait for: block briefly on them rather than spin.
            self.grammar_waitlist.wait(GRAMMAR_WAIT_S)
            self._admit_compiled()
        return failed + self._step()

    def _step(self) -> list[RequestOutput]:
        if self._overlap_outputs:
            return self._step_overlapping_outputs()
        sched = self.scheduler.schedule()
        if not self.async_scheduling:
            return self._apply(sched, self.executor.execute(sched))
        # Async: launch this step, then wait for the previous one and process its tokens while
        # this one runs. A step's deltas therefore come out of the next call.
        if self.executor.submit(sched):
            self._in_flight.append(sched)
            if (
                len(self._in_flight) < self.max_steps_in_flight
                and self.scheduler.has_unfinished_requests()
            ):
                return []  # room for another step: the next call schedules ahead of this one
        if not self._in_flight:
            return []
        deltas = self._apply(self._in_flight.popleft(), self.executor.collect())
        self._drain_if_idle()
        return deltas

    def _step_overlapping_outputs(self) -> list[RequestOutput]:
        """Async scheduling with speculative decoding: wait for the step in flight and apply its
        tokens to the scheduler (accepted counts, next drafts), schedule and launch the next
        step, and only then turn the tokens into outputs, while that step runs. The runner sees
        the same steps in the same order as synchronous stepping (one in flight, each scheduled
        from all earlier tokens), so the tokens are the same; a request ended by a stop string
        (found by the output processor) is then in one more step, whose tokens update() drops,
        as under plain async scheduling. A step's deltas come out of the next call."""
        core_outputs: list[EngineCoreOutput] | None = []
        deltas: list[RequestOutput] = []
        beam_candidates: dict[str, BeamCandidates] = {}
        if self._in_flight:
            runner_output = self.executor.collect()
            core_outputs = self.scheduler.update(self._in_flight.popleft(), runner_output)
            beam_candidates = runner_output.beam_candidates
            if self.beam_search.active:  # beams fork on their step's outputs: before scheduling
                deltas, core_outputs = self._process(core_outputs, beam_candidates), None
        sched = self.scheduler.schedule()
        if self.executor.submit(sched):
            self._in_flight.append(sched)
        if core_outputs is not None:
            deltas = self._process(core_outputs, beam_candidates)
        self._drain_if_idle()
        return deltas

    def _drain_if_idle(self) -> None:
        """No request left (finished early by a stop string, or aborted): what is still in flight
        only computes dropped tokens. Collect it now, so an idle engine holds no step."""
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            self._apply(self._in_flight.popleft(), self.executor.collect())

    def _apply(
        self, sched: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[RequestOutput]:
        core_outputs = self.scheduler.update(sched, runner_output)
        return self._process(core_outputs, runner_output.beam_candidates)

    def _process(
        self,
        core_outputs: list[EngineCoreOutput],
        beam_candidates: dict[str, BeamCandidates],
    ) -> list[RequestOutput]:
        """A step's outputs, applied by the scheduler, made into deltas; stop strings end their
        requests here."""
        finished_searches: list[RequestOutput] = []
        if self.beam_search.active:  # beams' one-token steps stay inside
            core_outputs, finished_searches = self.beam_search.consume(
                core_outputs, beam_candidates
            )
        deltas, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return deltas + finished_searches

    def finished_output(self, request_id: str) -> RequestOutput | None:
        """Pop the cumulative output of a finished request (None if unknown or unfinished)."""
        beam_final = self.beam_search.finished_output(request_id)
        if beam_final is not None:
            return beam_final
        state = self.output_processor.requests.get(request_id)
        if state is None or not state.finished:
            return None
        self.output_processor.pop(request_id)
        return state.snapshot()

    def shutdown(self) -> None:
        """Release the executor's workers and devices (a parallel engine's rank processes)."""
        self.executor.shutdown()

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
