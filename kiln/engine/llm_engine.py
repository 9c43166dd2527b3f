"""The synchronous engine: add requests, step, abort. LLM and the async server loop drive it."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections import deque
from typing import TypeVar

from kiln.config import EngineConfig
from kiln.engine.beam_search import BeamSearchManager
from kiln.engine.grammar_compiles import GrammarCompiles
from kiln.engine.hooks import EngineHook, NewRequest
from kiln.engine.loras import LoRARegistry, RegisteredLoRA
from kiln.engine.output_processor import OutputProcessor
from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import EngineCoreOutput, Scheduler
from kiln.errors import InvalidRequestError, LoRAError
from kiln.executor import create_executor
from kiln.interfaces import ModelRunnerOutput, SchedulerOutput
from kiln.kv_cache.hybrid import HybridKVCacheManager
from kiln.kv_cache.manager import KVCacheManager
from kiln.lora.request import LoRARequest
from kiln.lora.slots import LoRASlots
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger("kiln")
H = TypeVar("H", bound=EngineHook)
# A collected step's outputs, applied to the scheduler and taken by the hooks: (the outputs the
# output processor turns into deltas, final outputs the hooks made).
Applied = tuple[list[EngineCoreOutput], list[RequestOutput]]


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
        layout = self.model_config.kv_cache_layout
        self.kv_cache: KVCacheManager | HybridKVCacheManager
        if layout.is_hybrid:  # a block table per group (kiln.models.kv_groups)
            self.kv_cache = HybridKVCacheManager(
                capacity.num_blocks,
                capacity.block_size,
                config.enable_prefix_caching,
                windows=layout.windows,
            )
        else:
            self.kv_cache = KVCacheManager(
                capacity.num_blocks,
                capacity.block_size,
                config.enable_prefix_caching,
                sliding_window=self.model_config.kv_window,
            )
        self.scheduler = Scheduler(
            self.kv_cache,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            policy=config.scheduling_policy,
            num_spec_tokens=spec.num_tokens_for_batch if (spec := config.speculative) else None,
            lora_slots=LoRASlots(config.max_loras) if config.enable_lora else None,
        )
        # LoRA adapters registered with the runner, and the adapter of each unfinished request
        # that names one (kept until it is seen finished: removal waits for them).
        self.loras = LoRARegistry(
            self.executor.add_lora, self._drop_lora, self._lora_in_use, config.max_cpu_loras
        )
        self._lora_of_req: dict[str, int] = {}
        self.output_processor = OutputProcessor(self.tokenizer)
        # Features beside the scheduler (kiln.engine.hooks): beams are requests the search
        # queues; a request whose grammar compiles in the background is held out until ready.
        self.hooks: list[EngineHook] = [
            BeamSearchManager(self),
            GrammarCompiles(
                self.scheduler,
                self.tokenizer,
                facts.config.vocab_size,
                self.eos_token_ids,
                config.world_size,
            ),
        ]
        self._ids = itertools.count()
        self.async_scheduling = config.async_scheduling
        if self.async_scheduling is None:
            self.async_scheduling = self.device.startswith("cuda")
        # Speculative decoding: a step's drafts come from its own sampled tokens, and how many it
        # accepts decides where the next step starts, so the next step is scheduled only once
        # this one's tokens are back. What async scheduling overlaps instead is everything after
        # that: the previous step's outputs (detokenizing, stop strings, the caller's loop) are
        # made while the next step runs.
        self._collect_before_schedule = spec is not None and self.async_scheduling
        # Steps submitted before the oldest is collected: two under async scheduling (the next
        # is scheduled and launched while one runs); under pipeline parallelism one per stage, in
        # micro-batches of different requests (the scheduler then schedules no request whose
        # token is in flight), so stage 0 runs step n+1 while the last stage runs step n.
        self.max_steps_in_flight = 1
        if self.async_scheduling and not self._collect_before_schedule:
            self.max_steps_in_flight = max(2, config.pipeline_parallel_size)
        if self.async_scheduling and config.pipeline_parallel_size > 1:
            self.scheduler.num_micro_batches = config.pipeline_parallel_size
        self._in_flight: deque[SchedulerOutput] = deque()  # submitted to the runner, uncollected
        self._failed_deltas: list[RequestOutput] = []  # held requests that failed: next step()
        # Startup objects (model, tokenizer, graphs) live as long as the engine: keep the cyclic
        # GC from walking them on every full collection while requests churn. The collection
        # first takes what is garbage (a dropped engine's cycles). A process whose heap is frozen
        # already (another engine's startup, or an application that manages the GC, as a test
        # session or a preloading server does) keeps its freeze, which also keeps the collection
        # short: freezing it all again, then thawing it all at shutdown, would undo it.
        self._froze_gc = gc.get_freeze_count() == 0
        gc.collect()
        if self._froze_gc:
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

    def hook(self, kind: type[H]) -> H | None:
        """The engine's hook of this class (e.g. BeamSearchManager), if it has one."""
        return next((h for h in self.hooks if isinstance(h, kind)), None)

    def add_request(
        self,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request (a text prompt or token ids); returns its id.
        `lora_request`: the adapter it runs with (loaded now if its id is new; LoRAError if
        it cannot be), None for the base model."""
        params = params or self.default_sampling_params()
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.output_processor.requests or any(
            hook.owns(request_id) for hook in self.hooks
        ):
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt or [])
        self._validate(token_ids, params)
        lora_int_id = hash_root = None
        if lora_request is not None:
            if params.use_beam_search:
                raise InvalidRequestError(
                    "beam search with a LoRA adapter is not supported", param="lora_request"
                )
            lora = self._resolve_lora(lora_request)
            lora_int_id, hash_root = lora_request.lora_int_id, lora.hash_root
        max_tokens = self.max_model_len - len(token_ids)
        if params.max_tokens is not None:
            max_tokens = min(max_tokens, params.max_tokens)
        new = NewRequest(request_id, text, token_ids, params, max_tokens, priority)
        if any(hook.add_request(new) for hook in self.hooks):
            return request_id  # served by a hook (beam search)
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
                lora_int_id=lora_int_id,
                hash_root=hash_root,
            )
            if lora_int_id is not None:
                self._lora_of_req[child_id] = lora_int_id
            if not any(hook.hold(request) for hook in self.hooks):
                self.scheduler.add_request(request)
        self._release_held()  # queues what may go on already; a failed compile ends it now
        return request_id

    # ---- LoRA adapters -----------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load an adapter into host memory and register it under its id (vLLM's add_lora);
        False if that id is registered already. LoRAError, one line, if it cannot be served;
        the engine serves the others as before."""
        self._check_lora_enabled()
        return self.loras.add(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (its slot and host memory); False if no adapter has this id.
        LoRAError while an unfinished request uses it."""
        self._check_lora_enabled()
        return self.loras.remove(lora_int_id)

    def list_loras(self) -> set[int]:
        """The ids of the registered adapters (vLLM's list_loras)."""
        return self.loras.ids()

    def lora_requests(self) -> list[LoRARequest]:
        """The registered adapters, least recently used first."""
        return [lora.request for lora in self.loras.loras.values()]

    def _check_lora_enabled(self) -> None:
        if not self.config.enable_lora:
            raise LoRAError("LoRA adapters need an engine started with enable_lora=True")

    def _resolve_lora(self, lora_request: LoRARequest) -> RegisteredLoRA:
        self._check_lora_enabled()
        return self.loras.resolve(lora_request)

    def _drop_lora(self, lora_int_id: int) -> None:
        assert self.scheduler.lora_slots is not None  # (enable_lora)
        self.scheduler.lora_slots.forget(lora_int_id)
        self.executor.remove_lora(lora_int_id)

    def _lora_in_use(self, lora_int_id: int) -> bool:
        """Whether an unfinished request (queued, running or held by a hook) uses it."""
        live = self.scheduler.requests.keys() | {r for h in self.hooks for r in h.held_req_ids()}
        for req_id in [r for r in self._lora_of_req if r not in live]:
            del self._lora_of_req[req_id]
        return lora_int_id in self._lora_of_req.values()

    def _release_held(self) -> None:
        """Queue the held requests that may go on; those that cannot end, their deltas out of
        the next step()."""
        ended = [out for hook in self.hooks for out in hook.release()]
        if ended:
            deltas, _ = self.output_processor.process(ended)
            self._failed_deltas.extend(deltas)

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
        for hook in self.hooks:
            hook.validate(params)

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        """Abort requests: their KV blocks are freed now. Returns their final outputs."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        finals = []
        for req_id in request_ids:
            children = self.output_processor.child_ids(req_id)
            served = [f for hook in self.hooks if (f := hook.abort(req_id, children)) is not None]
            if served:  # a hook's own request (a beam search)
                finals += served
                continue
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
            or any(hook.has_work() for hook in self.hooks)
            or bool(self._failed_deltas)
        )

    @property
    def num_held(self) -> int:
        """Requests held out of scheduling by a hook (compiling grammars)."""
        return sum(len(hook.held_req_ids()) for hook in self.hooks)

    # ---- stepping ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns delta outputs of the requests that progressed.

        A delta's completions carry only this step's new text, tokens and logprobs; the full
        output of a finished request is `finished_output(req_id)`.
        """
        self._release_held()
        failed, self._failed_deltas = self._failed_deltas, []
        if not self._in_flight and not self.scheduler.has_unfinished_requests():
            # Only held requests to wait for (if any): block briefly on them rather than spin.
            for hook in self.hooks:
                hook.wait_for_held()
            self._release_held()
        return failed + self._step()

    def _step(self) -> list[RequestOutput]:
        """One loop for every schedule: submit the next step, and collect the oldest in flight
        either before scheduling (the schedule needs its tokens: speculation under async
        scheduling) or after submitting, once max_steps_in_flight are in flight (1 when
        synchronous: a step's deltas come out of the same call; 2, or one per pipeline stage,
        under async scheduling: out of the next call). The collected step's deltas are made
        last, while the submitted step runs; with speculation a request ended by a stop string
        is then in one more step, whose tokens update() drops, as under plain async scheduling."""
        applied: Applied | None = None
        before = self._collect_before_schedule
        if before and self._in_flight:
            applied = self._collect_oldest()
        sched = self.scheduler.schedule()
        submitted = self.executor.submit(sched)
        if submitted:
            self._in_flight.append(sched)
        if (
            not before
            and self._in_flight
            and (
                not submitted
                or len(self._in_flight) >= self.max_steps_in_flight
                or not self.scheduler.has_unfinished_requests()
            )
        ):
            applied = self._collect_oldest()
        deltas = self._to_deltas(applied) if applied is not None else []
        self._drain_if_idle()
        return deltas

    def _drain_if_idle(self) -> None:
        """No request left (finished early by a stop string, or aborted): what is still in flight
        only computes dropped tokens. Collect it now, so an idle engine holds no step."""
        while self._in_flight and not self.scheduler.has_unfinished_requests():
            self._to_deltas(self._collect_oldest())

    def _collect_oldest(self) -> Applied:
        return self._apply_to_scheduler(self._in_flight.popleft(), self.executor.collect())

    def _apply_to_scheduler(
        self, sched: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> Applied:
        """A step's tokens into the scheduler, and the hooks' outputs out of its outputs (beams
        fork their next step here: before the next schedule)."""
        core_outputs = self.scheduler.update(sched, runner_output)
        finals: list[RequestOutput] = []
        for hook in self.hooks:
            core_outputs, done = hook.consume(core_outputs, runner_output)
            finals += done
        return core_outputs, finals

    def _to_deltas(self, applied: Applied) -> list[RequestOutput]:
        """A step's outputs made into deltas; stop strings end their requests here."""
        core_outputs, finals = applied
        deltas, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return deltas + finals

    def finished_output(self, request_id: str) -> RequestOutput | None:
        """Pop the cumulative output of a finished request (None if unknown or unfinished)."""
        for hook in self.hooks:
            final = hook.finished_output(request_id)
            if final is not None:
                return final
        state = self.output_processor.requests.get(request_id)
        if state is None or not state.finished:
            return None
        self.output_processor.pop(request_id)
        return state.snapshot()

    def shutdown(self) -> None:
        """Release the executor's workers and devices (a parallel engine's rank processes), and
        thaw what startup froze so the engine's cycles are collectable once it is dropped."""
        self.executor.shutdown()
        if self._froze_gc:
            self._froze_gc = False  # a second shutdown must not thaw another engine's freeze
            gc.unfreeze()

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_cache.usage


def _with_seed(params: SamplingParams, seed: int) -> SamplingParams:
    from dataclasses import replace

    return replace(params, seed=seed)
