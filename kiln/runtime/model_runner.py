"""The data plane: submit(SchedulerOutput), then collect() -> ModelRunnerOutput.

Keeps a per-request copy of tokens and block tables, packs each step into persistent buffers, runs
the model over the paged KV cache (a CUDA graph for decode-only steps, eager otherwise), samples on
the device, and returns plain Python values to the scheduler. One device->host sync per step: the
sampled token ids (plus logprobs when asked for, in the same sync), waited for in collect().

submit() only launches work, so the engine can schedule and submit step N+1 before collecting
step N (async scheduling): a decode in N+1 whose input token N sampled reads it from N's sampled
ids on the device. The executor's execute() is submit() + collect(), the synchronous step.

Everything else a step may do (speculative verification and drafting, grammar masks, beam
search's top-K, prompt logprobs, EAGLE-3's hidden-state tap, step timing) is a StepHook that the
runner calls at fixed points of the step (kiln.runtime.step_hooks). One of those points lets a
hook defer a step's sampler (the grammar mask): it is launched in the next submit() or in
collect(), whichever comes first, so that a worker can prepare it meanwhile.
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections import deque
from typing import TYPE_CHECKING

import torch

from kiln.attention.backend import get_attention_backend
from kiln.distributed.comm import broadcast_sampled
from kiln.distributed.parallel_state import ParallelContext
from kiln.envs import envs
from kiln.interfaces import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kiln.kernel_cache import compile_watch
from kiln.kernels.kv_layout import empty_cache, empty_layer_cache
from kiln.kernels.ops import kernel_ops, resolve_kernel_backend
from kiln.lora.model import LoRAModel
from kiln.models.base import CausalLM
from kiln.runtime.graph_runner import GraphRunner
from kiln.runtime.in_flight import DeferredSample, InFlightStep, StepOutputs
from kiln.runtime.input_batch import CachedRequestState, InputBuffers, PackedBatch
from kiln.runtime.sampling_inputs import SamplingMetadataBuilder
from kiln.runtime.step_hooks import (
    TRACE_COLUMNS,  # noqa: F401 (kiln bench reads the trace's columns here)
    BeamTopKRows,
    DraftVerification,
    GrammarMask,
    PromptLogprobs,
    StepHook,
    StepHooks,
    StepTimer,
    TargetHiddenStateTap,
)
from kiln.sampling.sampler import LogprobsTensors, Sampler, SamplerOutput, logprobs_to_lists
from kiln.spec_decode.proposer import Proposer
from kiln.tokenizer import Tokenizer

if TYPE_CHECKING:
    import torch.distributed as dist

logger = logging.getLogger("kiln")


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_kv_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        attention_backend: str = "auto",
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        kv_cache_dtype: torch.dtype | None = None,
        tokenizer: Tokenizer | None = None,
        proposer: Proposer | None = None,
        lora: LoRAModel | None = None,
    ) -> None:
        self.model = model
        # LoRA adapters (kiln.lora): the model's LoRA layers, already attached; None: off.
        self.lora = lora
        # Speculative decoding: proposes each sampling request's next drafts once its tokens are
        # back (kiln.spec_decode); the scheduler sends them to verify in the next step.
        self.proposer = proposer
        cfg = model.config
        self.device = model.device
        self.dtype = model.dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.cos_sin_cache.shape[0]
        # Tensor/pipeline parallel (kiln/distributed): None in one process. `cfg` is then this
        # rank's shard (its KV heads and layers size the cache below).
        self.parallel: ParallelContext | None = getattr(model, "parallel", None)
        kernels = resolve_kernel_backend(attention_backend, self.device)
        self.ops = kernel_ops(kernels)
        self.backend = get_attention_backend(kernels, self.device)
        # Zeroed, not empty: padded block-table entries are read (and masked) by the reference
        # decode path, and masked garbage can still be NaN.
        kv_dtype = kv_cache_dtype or self.dtype
        shape = (num_kv_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        layout = model.full_config.kv_cache_layout
        self.num_kv_groups = len(layout.groups)
        if layout.is_hybrid:
            self.kv_caches = _shared_slot_caches(model, shape, kv_dtype)
        else:
            self.kv_caches = [
                empty_layer_cache(shape, kv_dtype, self.device, _zeros, cfg.kv_tensors_per_layer)
                for _ in range(cfg.num_hidden_layers)
            ]
        # Block copies: each tensor once (a hybrid model's layers share them, an MLA layer's
        # K and V are one).
        distinct = {id(pair): pair for pair in self.kv_caches}.values()
        tensors = {id(cache): cache for pair in distinct for cache in pair}
        self._all_caches = list(tensors.values())
        self.inputs = InputBuffers(
            max_num_batched_tokens,
            max_num_seqs,
            self.max_model_len,
            block_size,
            self.device,
            self.num_kv_groups,
        )
        self.sampler = Sampler(argmax=self.ops.argmax)
        self.sampling = SamplingMetadataBuilder(eos_token_ids, self.vocab_size, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self._in_flight: deque[InFlightStep] = deque()  # submitted, not yet collected
        # The submitted step whose sampler a hook deferred (launched by the next submit or
        # collect, whichever comes first): see _launch_deferred_sample.
        self._deferred: InFlightStep | None = None
        self.hooks = StepHooks(self._features(tokenizer))
        self.graphs = None if enforce_eager else self._capture_graphs()
        self._last_sampled: torch.Tensor | None = None  # the latest step's sampled ids (device)
        # TP/PP ranks other than the driver: the pending receive of the driver's ids (a
        # torch.distributed Work), waited on only when they are read.
        self._sampled_arrival: dist.Work | None = None
        self._last_arrival: dist.Work | None = None
        self._num_sampling_steps = 0  # steps that sampled so far (CachedRequestState.pending_step)
        self._host_slot = 0  # which of the two pinned buffers the next step's ids land in
        # A step whose every sampling row verified drafts samples no ids: this, never written.
        self._no_ids = torch.zeros(0, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            compile_watch.WATCH.start()  # the profile and the graphs compiled what steps need

    def _capture_graphs(self) -> GraphRunner | None:
        fake = self.device.type == "cpu" and envs().cpu_fake_graphs  # tests, no GPU
        if not (fake or (self.device.type == "cuda" and self.backend.supports_cuda_graphs)):
            return None
        # Under TP the all-reduces are captured inside (NCCL collectives on the capturing
        # stream); each rank captures the same keys in the same order, so their captures'
        # warm-up forwards meet in the same collectives.
        graphs = GraphRunner(
            self.model,
            self.ops,
            self.backend,
            self.kv_caches,
            self.inputs,
            self.max_num_seqs,
            self.max_model_len,
            fake=fake,
            lora_inputs=self.lora.inputs if self.lora is not None else None,
        )
        graphs.capture()
        return graphs

    def _features(self, tokenizer: Tokenizer | None) -> list[StepHook]:
        """The step's hooks, in the order each point calls them."""
        hooks: list[StepHook] = []
        proposer = self.proposer
        if proposer is not None and proposer.uses_target_hidden_states:  # EAGLE-3
            hooks.append(TargetHiddenStateTap(proposer, self.model))
        hooks.append(PromptLogprobs(self.model, self.ops, self.max_num_seqs))
        hooks.append(
            GrammarMask(
                tokenizer, self.vocab_size, self.eos_token_ids, self.device, self._in_flight
            )
        )
        if proposer is not None:
            hooks.append(
                DraftVerification(
                    proposer,
                    self.sampler,
                    self.eos_token_ids,
                    self.vocab_size,
                    self.device,
                    self.inputs.max_num_tokens,
                    self.requests,
                )
            )
        hooks.append(BeamTopKRows(self.device))
        return hooks

    @property
    def step_timing(self) -> dict | None:
        """Host (and GPU) phase totals and a per-step trace (StepTimer); None while off. Set
        it to {} to start recording into that dict, to None to stop."""
        timer = self.hooks.get(StepTimer)
        return None if timer is None else timer.totals

    @step_timing.setter
    def step_timing(self, totals: dict | None) -> None:
        self.hooks.remove(StepTimer)
        if totals is not None:
            self.hooks.add(StepTimer(totals, self.device), first=True)

    # ---- state -------------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        hooks = self.hooks
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.inputs.remove_request(state.row)
            hooks.remove_request(req_id)
        for new in sched.new_requests:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self.inputs.remove_request(old.row)
            block_ids = new.block_ids
            if self.num_kv_groups > 1:  # each group's in turn: the state keeps the first's
                block_ids = block_ids[: len(block_ids) // self.num_kv_groups]
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(block_ids),
                num_computed_tokens=new.num_computed_tokens,
                lora_int_id=new.lora_int_id,
            )
            hooks.add_request(state)
            state.row = self.inputs.add_request(new.block_ids)
            self.requests[new.req_id] = state
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            if state.spec_token_ids:
                # It verified drafts: the scheduler gave back the blocks only rejected ones used.
                del state.block_ids[-(-cached.num_computed_tokens // self.block_size) :]
                state.spec_token_ids = []
            new_ids = cached.new_block_ids
            if new_ids:
                self.inputs.append_blocks(state.row, len(state.block_ids), new_ids)
                if self.num_kv_groups > 1:
                    new_ids = new_ids[: len(new_ids) // self.num_kv_groups]
                state.block_ids.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> bool:
        """Launch a step; False if it had no tokens (then there is nothing to collect)."""
        t0 = time.perf_counter()
        self._update_states(sched)
        if sched.lora_loads:  # before any forward that reads the adapters' slots
            assert self.lora is not None  # the scheduler places adapters only with LoRA on
            self.lora.load_slots(sched.lora_loads)
        if sched.block_copies:  # before any step's forward reads or writes these blocks
            self._copy_blocks(sched.block_copies)
        if sched.is_empty:
            self._launch_deferred_sample()
            return False
        states, num_scheduled, num_decodes = self._batch_order(sched)
        for req_id, drafts in sched.scheduled_spec_decode_tokens.items():
            self.requests[req_id].spec_token_ids = drafts
        latest = self._num_sampling_steps
        if self._in_flight and any(
            s.num_pending and (s.needs_history or s.pending_step != latest) for s in states
        ):
            # Penalties read every generated token: bring the running step's ids back first.
            # So too for a pending token of an older step than the latest (pending inputs are
            # read from the latest step's ids): a pipeline stage's older micro-batch.
            self._resolve_in_flight()
        flatten, graph_key = self._layout(sched, states, num_scheduled, num_decodes)
        batch = self.inputs.prepare(states, num_scheduled, graph_key and graph_key[0], flatten)
        if self.lora is not None:
            self.lora.fill_token_slots(
                [s.lora_int_id for s in states], num_scheduled, batch.num_padded_seqs
            )
        # A deferred sampler is launched as late as it can be, just before this step's forward
        # (whose inputs may be its tokens): the host work up to here (states, block copies,
        # packing) ran while its hook prepared it. Its rows are marked pending already, so the
        # packing read their tokens from its ids on the device.
        self._launch_deferred_sample()
        step = InFlightStep(sched, graph_key is not None, len(states))
        t1 = time.perf_counter()
        self.hooks.before_forward(step)
        if batch.num_pending_inputs:
            self._fill_pending_inputs(batch.num_pending_inputs)
        if graph_key is not None:
            assert self.graphs is not None  # a graph key comes from the graphs
            hidden = self.graphs.replay(graph_key)
        else:
            hidden = self.model(
                self.ops,
                self.backend,
                batch.input_ids,
                batch.positions,
                self.kv_caches,
                batch.metadata,
            )
        t2 = time.perf_counter()
        self.hooks.after_forward(step, states, batch, hidden)
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        self._in_flight.append(step)
        if not batch.sampling_rows:  # a step of prompt chunks only: nothing to sample or wait for
            step.times = (t0, t1, t2, t2)
            return True
        rows = batch.sampling_rows  # increasing: all of them is every row, in order
        step.states = states if len(rows) == len(states) else [states[r] for r in rows]
        if self.parallel is not None:
            self._sample_parallel(hidden, batch, step)
        else:
            self._sample(step, self.model.compute_logits(_logits_rows(hidden, batch), self.ops))
        step.times = (t0, t1, t2, time.perf_counter())
        return True

    def _batch_order(
        self, sched: SchedulerOutput
    ) -> tuple[list[CachedRequestState], list[int], int]:
        """The step's requests in batch order, their token counts, and how many decodes lead:
        decodes (one token) first, as the attention backend takes them in one batched call."""
        scheduled = sched.num_scheduled_tokens
        # Decodes alone (one token each: as many tokens as requests, none with fewer than one).
        if sched.total_num_scheduled_tokens == len(scheduled) and min(scheduled.values()) == 1:
            req_ids = list(scheduled)
            num_scheduled = [1] * len(req_ids)
            num_decodes = len(req_ids)
        else:
            req_ids = [r for r, n in scheduled.items() if n == 1]
            num_decodes = len(req_ids)
            req_ids += [r for r, n in scheduled.items() if n != 1]
            num_scheduled = [scheduled[r] for r in req_ids]
        return list(map(self.requests.__getitem__, req_ids)), num_scheduled, num_decodes

    def _layout(
        self,
        sched: SchedulerOutput,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        num_decodes: int,
    ) -> tuple[bool, tuple[int, int] | None]:
        """Whether the step runs as one attention row per token, and its CUDA graph (None:
        eager). Verification steps of decodes alone run as a decode batch of one row per token
        (graphs too); with prefill chunks in the step, as chunks of K + 1 tokens."""
        spec = sched.scheduled_spec_decode_tokens
        scheduled = sched.num_scheduled_tokens
        flatten = bool(spec) and (
            sched.total_num_scheduled_tokens <= self.inputs.max_num_seqs
            and all(n == 1 + len(spec.get(r, ())) for r, n in scheduled.items())
        )
        if self.graphs is None or not (flatten or num_decodes == len(states)):
            return flatten, None
        num_rows = sched.total_num_scheduled_tokens if flatten else len(states)
        max_seq_len = max(s.num_computed_tokens + n for s, n in zip(states, num_scheduled))
        return flatten, self.graphs.lookup(num_rows, max_seq_len)

    def _sample(self, step: InFlightStep, logits: torch.Tensor) -> None:
        """Launch the sampler over the sampling rows' logits (what the hooks left of them), or
        defer it for the hook that asks."""
        logits = self.hooks.on_logits(step, logits)  # verification takes its rows out
        # Built before the rows are marked pending, also for a deferred sampler: the seeded
        # generators and min_tokens count the tokens sampled before this step, not its own.
        metadata = self.sampling.build(step.states) if step.states else None
        hook = self.hooks.deferring(step)
        if hook is not None:
            assert metadata is not None, "a hook defers only a step with rows to sample"
            step.deferred = DeferredSample(logits, metadata, hook)
            self._deferred = step
            self._mark_pending(step)
            return
        if metadata is not None:
            result = self.sampler(logits, metadata)
        else:  # every sampling row verified drafts
            result = SamplerOutput(self._no_ids, None)
        self._mark_pending(step)
        self._sampled(step, result)

    def _sampled(self, step: InFlightStep, result: SamplerOutput) -> None:
        """A step's sampler is launched: start its copy to the host (its rows are marked
        pending already)."""
        self.hooks.sampler_launched(step)
        step.sampled = result.sampled_token_ids
        step.arrival, self._sampled_arrival = self._sampled_arrival, None
        self._copy_to_host(step, result)
        self._last_sampled, self._last_arrival = step.sampled, step.arrival

    def _mark_pending(self, step: InFlightStep) -> None:
        """A step's rows will have a token in its sampled ids (launched now, or when its
        deferred sampler is): the next step reads them from there."""
        self._num_sampling_steps += 1
        assert step.states is not None  # set before its sampler is launched or deferred
        for index, state in enumerate(step.states):
            state.num_pending += 1
            state.pending_index = index
            state.pending_step = self._num_sampling_steps

    @torch.inference_mode()
    def _launch_deferred_sample(self) -> None:
        """Sample the step whose sampler a hook deferred. The hook's work may need the older
        steps' tokens: finish those first (a no-op on the engine's usual path, which has
        collected them already)."""
        step = self._deferred
        if step is None:
            return
        for older in self._in_flight:
            if older is step:
                break
            if older.output is None:
                self._finish(older)
        self._deferred = None
        deferred, step.deferred = step.deferred, None
        assert deferred is not None
        metadata = deferred.hook.deferred_metadata(step, deferred.metadata)
        self._sampled(step, self.sampler(deferred.logits, metadata))

    def _copy_blocks(self, block_copies: list[tuple[int, int]]) -> None:
        """Copy-on-write forks (KVCacheManager.fork): each (source, destination) block of every
        layer's K and V, in one kernel on the GPU, queued before this step's forward."""
        mapping = torch.tensor(block_copies, dtype=torch.int64)  # [num_copies, 2]
        if self.device.type == "cuda":
            # Pinned, so the copy is asynchronous; torch's pinned-memory cache keeps the buffer
            # until the copy has read it.
            mapping = mapping.pin_memory().to(self.device, non_blocking=True)
        self.ops.copy_kv_blocks(self._all_caches, mapping)

    def _sample_parallel(
        self, hidden: torch.Tensor, batch: PackedBatch, step: InFlightStep
    ) -> None:
        """TP/PP: the last stage's tensor ranks make the logits together (a collective), the
        driver (global rank 0) samples, and every rank gets the ids (so each keeps the same
        token history). Logprobs exist on the driver only, the one rank whose output is read."""
        parallel, states = self.parallel, step.states
        assert parallel is not None and states is not None  # (TP/PP; a step that samples)
        sampled: torch.Tensor | None = None
        logprobs: LogprobsTensors | None = None
        if self.model.computes_logits:
            logits = self.model.compute_logits(_logits_rows(hidden, batch), self.ops)
            if parallel.layout.samples:
                logits = self.hooks.on_logits(step, logits)  # (beams; no drafts or grammars)
                result = self.sampler(logits, self.sampling.build(states))
                sampled, logprobs = result.sampled_token_ids, result.logprobs
        sampled, self._sampled_arrival = broadcast_sampled(
            parallel, sampled, len(states), self.device
        )
        self._mark_pending(step)
        self._sampled(step, SamplerOutput(sampled, logprobs))

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest submitted step's sampled ids and return them."""
        if self._in_flight[0] is self._deferred:
            self._launch_deferred_sample()
        if self._in_flight[0].output is None:
            self._finish(self._in_flight[0])
        output = self._in_flight.popleft().output
        assert output is not None  # _finish made it
        return output

    def _resolve_in_flight(self) -> None:
        self._launch_deferred_sample()
        for step in self._in_flight:
            if step.output is None:
                self._finish(step)

    def _fill_pending_inputs(self, k: int) -> None:
        """Input tokens the previous step sampled, copied on the device: no wait for the host."""
        buf = self.inputs
        if self._last_arrival is not None:  # TP/PP: the driver's ids have landed (stream order)
            self._last_arrival.wait()
            self._last_arrival = None
        assert self._last_sampled is not None  # pending inputs follow a step that sampled
        buf.input_ids.index_copy_(
            0, buf.pending_dst[:k], self._last_sampled.index_select(0, buf.pending_src[:k])
        )

    def _copy_to_host(self, step: InFlightStep, result: SamplerOutput) -> None:
        """Start the step's one device->host copy (ids, logprobs if asked for, and the hooks')."""
        if step.arrival is not None:
            return  # the driver's ids are still on their way: copied in _finish, once waited for
        if self.device.type != "cuda":
            step.host_sampled, step.host_logprobs = step.sampled, result.logprobs
            self.hooks.copy_to_host(step)
            return
        self._host_slot ^= 1
        sampled = result.sampled_token_ids  # (step.sampled, set by the caller)
        num_ids = sampled.shape[0]
        host = self.inputs.sampled_cpu[self._host_slot][:num_ids]
        if num_ids:  # (none: every row verified drafts, whose ids the verification copies)
            host.copy_(sampled, non_blocking=True)
        step.host_sampled = host
        if result.logprobs is not None:
            step.host_logprobs = result.logprobs.to_host()
        self.hooks.copy_to_host(step)
        step.done = torch.cuda.Event()
        step.done.record()

    def _finish(self, step: InFlightStep) -> None:
        """Wait for a step's ids and hand them to its requests' states (the one sync), then to
        the hooks."""
        t4 = t5 = t6 = time.perf_counter()
        out = StepOutputs()
        states = step.states
        if states is not None:
            if step.arrival is not None:  # a rank other than the driver: its ids, received
                step.arrival.wait()
                if step.arrival is self._last_arrival:
                    self._last_arrival = None
                assert step.sampled is not None  # received into it
                step.arrival, step.host_sampled = None, step.sampled.cpu()
            if step.done is not None:
                step.done.synchronize()
            t5 = time.perf_counter()
            self._take_tokens(step, states, out)
        self.hooks.finish(step, out)
        step.output = out.freeze()
        if states is not None:
            t6 = time.perf_counter()
        step.times = (*step.times, t4, t5, t6)
        self.hooks.collected(step)

    def _take_tokens(
        self, step: InFlightStep, states: list[CachedRequestState], out: StepOutputs
    ) -> None:
        """The sampled ids (and logprobs) on the host, into the rows' states (`step.states`)
        and the output."""
        assert step.host_sampled is not None  # copied (or received) before the step finishes
        out.row_token_ids = sampled = step.host_sampled.tolist()
        sampled_ids = out.sampled_token_ids
        for state, token_id in zip(states, sampled):
            state.output_token_ids.append(token_id)
            state.token_ids.append(token_id)
            state.num_pending -= 1
            sampled_ids[state.req_id] = [token_id]
        if step.host_logprobs is not None:
            rows = logprobs_to_lists(step.host_logprobs)
            for i, state in enumerate(states):
                n = state.sampling_params.logprobs
                if n is not None:
                    ids, lps, rank = rows[i]
                    out.logprobs[state.req_id] = [TokenLogprobs(ids[: n + 1], lps[: n + 1], rank)]


def _logits_rows(hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """The hidden states of the step's logits rows: a view where they lead the batch (decodes;
    verification steps of decodes alone), else a gather."""
    if batch.logits_indices is None:
        return hidden[: batch.num_logits_rows]
    return hidden[batch.logits_indices]


def _shared_slot_caches(
    model: CausalLM, shape: tuple[int, int, int, int], kv_dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A hybrid model's per-layer caches: layer i writes the K/V tensors of its slot, which one
    layer of every KV cache group shares (kiln.models.kv_groups); a pipeline stage makes only
    the slots its layers use."""
    placement = model.full_config.kv_cache_layout.placement()
    device = model.device
    layers = range(model.layer_start, model.layer_start + model.config.num_hidden_layers)
    slots = {
        slot: (
            empty_cache(*shape, kv_dtype, device, _zeros),
            empty_cache(*shape, kv_dtype, device, _zeros),
        )
        for slot in sorted({placement[i][1] for i in layers})
    }
    return [slots[placement[i][1]] for i in layers]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor. On the CPU, over an anonymous memory map: the kernel hands out its pages
    zeroed as they are first touched, where torch.zeros wrote all 2 GiB of the default KV budget
    up front (1.7 s of a 2-core machine's startup, for blocks most runs never use)."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    flat = torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)  # keeps the map alive
    return flat.view(dtype).view(shape)
