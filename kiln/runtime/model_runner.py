"""The data plane: submit(SchedulerOutput), then collect() -> ModelRunnerOutput.

Keeps a per-request copy of tokens and block tables, packs each step into persistent buffers, runs
the model over the paged KV cache (a CUDA graph for decode-only steps, eager otherwise), samples on
the device, and returns plain Python values to the scheduler. One device->host sync per step: the
sampled token ids (plus logprobs when asked for, in the same sync), waited for in collect().

submit() only launches work, so the engine can schedule and submit step N+1 before collecting
step N (async scheduling): a decode in N+1 whose input token N sampled reads it from N's sampled
ids on the device. The executor's execute() is submit() + collect(), the synchronous step.
A step with grammar rows launches its sampler later, in the next submit() or its collect(),
so that a worker can fill its token mask meanwhile (kiln.structured_output).
"""

from __future__ import annotations

import logging
import math
import mmap
import time
from collections import deque
from dataclasses import dataclass, field, replace

import torch

from kiln.attention.backend import get_attention_backend
from kiln.distributed.comm import broadcast_sampled
from kiln.envs import envs
from kiln.interfaces import (
    BeamCandidates,
    BeamRow,
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SchedulerOutput,
    TokenLogprobs,
)
from kiln.kernel_cache import compile_watch
from kiln.kernels.kv_layout import empty_cache
from kiln.kernels.ops import kernel_ops, resolve_kernel_backend
from kiln.models.base import CausalLM
from kiln.runtime.graph_runner import GraphRunner
from kiln.runtime.input_batch import CachedRequestState, InputBuffers, PackedBatch
from kiln.runtime.sampling_inputs import (
    SamplingMetadataBuilder,
    build_sampling_metadata,
    verification_rows,
)
from kiln.sampling.beam import BeamTopK, beam_top_k
from kiln.sampling.host_copy import to_device
from kiln.sampling.rejection_sampler import emitted_tokens, rejection_sample
from kiln.sampling.sampler import LogprobsTensors, Sampler, SamplerOutput, compute_logprobs
from kiln.spec_decode.proposer import Proposer

logger = logging.getLogger("kiln")

# ModelRunner.step_timing["trace"] rows; times in ms.
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
        tokenizer: object | None = None,
        proposer: Proposer | None = None,
    ) -> None:
        self.model = model
        # Speculative decoding: proposes each sampling request's next drafts once its tokens are
        # back (kiln.spec_decode); the scheduler sends them to verify in the next step.
        self.proposer = proposer
        cfg = model.config
        self.device = model.norm.device
        self.dtype = model.norm.dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.cos_sin_cache.shape[0]
        # Tensor/pipeline parallel (kiln/distributed): None in one process. `cfg` is then this
        # rank's shard (its KV heads and layers size the cache below).
        self.parallel = getattr(model, "parallel", None)
        kernels = resolve_kernel_backend(attention_backend, self.device)
        self.ops = kernel_ops(kernels)
        self.backend = get_attention_backend(kernels, self.device)
        # Zeroed, not empty: padded block-table entries are read (and masked) by the reference
        # decode path, and masked garbage can still be NaN.
        kv_dtype = kv_cache_dtype or self.dtype
        shape = (num_kv_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            tuple(empty_cache(*shape, kv_dtype, self.device, _zeros) for _ in "kv")
            for _ in range(cfg.num_hidden_layers)
        ]
        self._all_caches = [cache for pair in self.kv_caches for cache in pair]  # block copies
        self.inputs = InputBuffers(
            max_num_batched_tokens, max_num_seqs, self.max_model_len, block_size, self.device
        )
        self.sampler = Sampler(argmax=self.ops.argmax)
        self.sampling = SamplingMetadataBuilder(eos_token_ids, self.vocab_size, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        # Those of them that asked for prompt logprobs: most steps have none, and looking
        # through every state for them costs ~0.1 ms a step at 512 requests.
        self._prompt_logprobs_ids: set[str] = set()
        self.tokenizer = tokenizer  # for grammars (structured output), built on first use
        self._grammars = None  # kiln.structured_output.GrammarBatch
        # The submitted step whose sampler waits for its grammar mask (launched by the next
        # submit or collect, whichever comes first): see _launch_deferred_sample.
        self._deferred: _InFlightStep | None = None
        self.graphs: GraphRunner | None = None
        fake_graphs = self.device.type == "cpu" and envs().cpu_fake_graphs  # tests, no GPU
        cuda_graphs = self.device.type == "cuda" and self.backend.supports_cuda_graphs
        if (cuda_graphs or fake_graphs) and not enforce_eager:
            # Under TP the all-reduces are captured inside (NCCL collectives on the capturing
            # stream); each rank captures the same keys in the same order, so their captures'
            # warm-up forwards meet in the same collectives.
            self.graphs = GraphRunner(
                model,
                self.ops,
                self.backend,
                self.kv_caches,
                self.inputs,
                max_num_seqs,
                self.max_model_len,
                fake=fake_graphs,
            )
            self.graphs.capture()
        self.step_timing: dict[str, float] | None = None  # set to {} to collect host timings
        self._in_flight: deque[_InFlightStep] = deque()  # submitted, not yet collected
        self._last_sampled: torch.Tensor | None = None  # the latest step's sampled ids (device)
        # TP/PP ranks other than the driver: the pending receive of the driver's ids (a
        # torch.distributed Work), waited on only when they are read.
        self._sampled_arrival = self._last_arrival = None
        self._num_sampling_steps = 0  # steps that sampled so far (CachedRequestState.pending_step)
        self._host_slot = 0  # which of the two pinned buffers the next step's ids land in
        # A step whose every sampling row verified drafts samples no ids: this, never written.
        self._no_ids = torch.zeros(0, dtype=torch.long, device=self.device)
        if self.device.type == "cuda":
            compile_watch.WATCH.start()  # the profile and the graphs compiled what steps need

    # ---- state -------------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.inputs.remove_request(state.row)
            self._prompt_logprobs_ids.discard(req_id)
            if self._grammars is not None:
                self._grammars.remove(req_id)
            if self.proposer is not None:
                self.proposer.remove(req_id)
        for new in sched.new_requests:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self.inputs.remove_request(old.row)
            if new.sampling_params.guided_decoding is not None:
                self._grammar_batch().add(
                    new.req_id, new.sampling_params.guided_decoding, new.output_token_ids
                )
            if self.proposer is not None:
                self.proposer.remove(new.req_id)
            state = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            state.row = self.inputs.add_request(state.block_ids)
            self.requests[new.req_id] = state
            if new.sampling_params.prompt_logprobs is not None:
                self._prompt_logprobs_ids.add(new.req_id)
            else:  # (a request id used again)
                self._prompt_logprobs_ids.discard(new.req_id)
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            if state.spec_token_ids:
                # It verified drafts: the scheduler gave back the blocks only rejected ones used.
                del state.block_ids[-(-cached.num_computed_tokens // self.block_size) :]
                state.spec_token_ids = []
            if cached.new_block_ids:
                self.inputs.append_blocks(state.row, len(state.block_ids), cached.new_block_ids)
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def _grammar_batch(self):  # -> kiln.structured_output.GrammarBatch
        if self._grammars is None:
            from kiln.structured_output import GrammarBatch, compiler_for

            compiler = compiler_for(self.tokenizer, self.vocab_size, self.eos_token_ids)
            self._grammars = GrammarBatch(compiler)
        return self._grammars

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def submit(self, sched: SchedulerOutput) -> bool:
        """Launch a step; False if it had no tokens (then there is nothing to collect)."""
        timing = self.step_timing
        t0 = time.perf_counter()
        # A previous step whose sampler waits for its grammar mask is launched as late as it
        # can be, just before this step's forward (whose inputs may be its tokens): the host
        # work up to there (states, block copies, packing the batch) runs while its mask is
        # filled. Its rows are marked pending already (so the packing reads their tokens from
        # its ids on the device), and the fill holds its own matchers, so removing finished
        # requests' matchers below does not touch it.
        self._update_states(sched)
        if sched.block_copies:  # before any step's forward reads or writes these blocks
            self._copy_blocks(sched.block_copies)
        if sched.is_empty:
            self._launch_deferred_sample()
            return False
        # Decodes (one token) first: the attention backend takes them as one batched call.
        scheduled = sched.num_scheduled_tokens
        # Decodes alone (one token each: as many tokens as requests, none with fewer than one).
        if sched.total_num_scheduled_tokens == len(scheduled) and min(scheduled.values()) == 1:
            req_ids = list(scheduled)
            num_decodes = len(req_ids)
            num_scheduled = [1] * num_decodes
        else:
            req_ids = [r for r, n in scheduled.items() if n == 1]
            num_decodes = len(req_ids)
            req_ids += [r for r, n in scheduled.items() if n != 1]
            num_scheduled = [scheduled[r] for r in req_ids]
        states = list(map(self.requests.__getitem__, req_ids))
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

        graph_key = None
        # Verification steps of decodes alone run as a decode batch of one row per token (graphs
        # too); with prefill chunks in the step, as chunks of K + 1 tokens.
        spec = sched.scheduled_spec_decode_tokens
        flatten = bool(spec) and (
            sched.total_num_scheduled_tokens <= self.inputs.max_num_seqs
            and all(n == 1 + len(spec.get(r, ())) for r, n in scheduled.items())
        )
        num_rows = sched.total_num_scheduled_tokens if flatten else len(states)
        if self.graphs is not None and (flatten or num_decodes == len(req_ids)):
            max_seq_len = max(s.num_computed_tokens + n for s, n in zip(states, num_scheduled))
            graph_key = self.graphs.lookup(num_rows, max_seq_len)
        batch = self.inputs.prepare(states, num_scheduled, graph_key and graph_key[0], flatten)
        self._launch_deferred_sample()
        t1 = time.perf_counter()
        gpu_events = None
        if timing is not None and self.device.type == "cuda":
            gpu_events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            gpu_events[0].record()
        if batch.num_pending_inputs:
            self._fill_pending_inputs(batch.num_pending_inputs)
        if graph_key is not None:
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
        if self.proposer is not None and self.proposer.uses_target_hidden_states:  # EAGLE-3
            self.proposer.record_target_hidden_states(
                states, num_scheduled, batch.query_start_loc_np, self.model.aux_hidden_states
            )
        prompt_logprobs = self._prompt_logprobs(batch, states, hidden)
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        step = _InFlightStep(sched, graph_key is not None, len(states), prompt_logprobs)
        self._in_flight.append(step)
        if not batch.sampling_rows:  # a step of prompt chunks only: nothing to sample or wait for
            step.times = (t0, t1, t2, t2)
            return True

        rows = batch.sampling_rows  # increasing: all of them is every row, in order
        step.states = states if len(rows) == len(states) else [states[r] for r in rows]
        if self.parallel is not None:
            result = self._sample_parallel(hidden, batch, step)
        else:
            logits = self.model.compute_logits(_logits_rows(hidden, batch), self.ops)
            if sched.scheduled_spec_decode_tokens:
                logits = self._verify(step, logits)
            if sched.beam_rows:
                self._beam_top_k(step, logits)
            grammars = self._grammars
            if grammars is not None and grammars.has_grammar([s.req_id for s in step.states]):
                # Grammar rows get no drafts, so none verifies here. Their mask needs the older
                # steps' tokens: a worker fills it from when those are on the host (now, or
                # when the previous step's copy lands, which the worker waits for itself) while
                # the device runs this forward and this thread goes on with the engine loop;
                # the sampler is launched when the next submit or collect needs it.
                # Its sampling metadata is built now, before its rows are marked pending, as
                # the undeferred path below builds it: the seeded generators and min_tokens
                # count the tokens sampled before this step, not this step's own.
                step.deferred = (logits, gpu_events, self.sampling.build(step.states))
                self._deferred = step
                self._mark_pending(step)
                self._start_deferred_fill()
                step.times = (t0, t1, t2, time.perf_counter())
                return True
            if step.states:
                result = self.sampler(logits, self.sampling.build(step.states))
            else:  # every sampling row verified drafts
                result = SamplerOutput(self._no_ids, None)
        self._mark_pending(step)
        self._sampled(step, result, gpu_events)
        step.times = (t0, t1, t2, time.perf_counter())
        return True

    def _sampled(
        self, step: _InFlightStep, result: SamplerOutput, gpu_events: tuple | None
    ) -> None:
        """A step's sampler is launched: start its copy to the host (its rows are marked
        pending already)."""
        if gpu_events is not None:
            gpu_events[1].record()
        step.gpu_events = gpu_events
        step.sampled = result.sampled_token_ids
        step.arrival, self._sampled_arrival = self._sampled_arrival, None
        self._copy_to_host(step, result.logprobs)
        self._last_sampled, self._last_arrival = step.sampled, step.arrival

    def _mark_pending(self, step: _InFlightStep) -> None:
        """A step's rows will have a token in its sampled ids (launched now, or when its
        grammar mask is ready): the next step reads them from there."""
        self._num_sampling_steps += 1
        for index, state in enumerate(step.states):
            state.num_pending += 1
            state.pending_index = index
            state.pending_step = self._num_sampling_steps

    def _start_deferred_fill(self) -> None:
        """Start the deferred step's mask. Its fill needs every older step's tokens: the
        collected ones are queued in the matchers already; those of steps still in flight
        (the previous step, whose sampler was launched just before this step's forward) the
        worker takes from their host copy as soon as it lands, so the fill starts then, not
        when this thread gets round to collecting them. Under TP/PP (structured output is
        refused there) a rank's ids may not be copied yet: then _finish calls back here."""
        step = self._deferred
        if step is None or step.pending_mask is not None:
            return
        from kiln.structured_output.matchers import IncomingTokens

        incoming = []
        for older in self._in_flight:
            if older is step:
                break
            if older.output is not None or older.states is None:
                continue  # collected (tokens queued), or a step of prompt chunks only
            if older.arrival is not None or older.host_sampled is None:
                return
            incoming.append(older)
        for older in incoming:
            older.tokens_to_grammar = False  # the fill takes them: _finish must not queue them
        step.pending_mask = self._grammars.start_fill(
            [s.req_id for s in step.states],
            self.device,
            [
                IncomingTokens(o.host_sampled, o.done, [s.req_id for s in o.states])
                for o in incoming
            ],
        )

    @torch.inference_mode()
    def _launch_deferred_sample(self) -> None:
        """Sample the step that waits for its grammar mask. Its fill needs the older steps'
        tokens: finish those first (a no-op on the engine's usual path, which has collected
        them already)."""
        step = self._deferred
        if step is None:
            return
        for older in self._in_flight:
            if older is step:
                break
            if older.output is None:
                self._finish(older)
        self._start_deferred_fill()
        self._deferred = None
        logits, gpu_events, metadata = step.deferred
        pending, step.deferred, step.pending_mask = step.pending_mask, None, None
        bitmask = self._grammars.finish_fill(pending, self.device)
        if bitmask is not None:
            metadata = replace(metadata, token_bitmask=bitmask)
        self._sampled(step, self.sampler(logits, metadata), gpu_events)

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
        self, hidden: torch.Tensor, batch: PackedBatch, step: _InFlightStep
    ) -> SamplerOutput:
        """TP/PP: the last stage's tensor ranks make the logits together (a collective), the
        driver (global rank 0) samples, and every rank gets the ids (so each keeps the same
        token history). Logprobs exist on the driver only, the one rank whose output is read."""
        sampled = logprobs = None
        states = step.states
        if self.model.computes_logits:
            logits = self.model.compute_logits(_logits_rows(hidden, batch), self.ops)
            if self.parallel.layout.samples:
                if step.sched.beam_rows:
                    self._beam_top_k(step, logits)
                result = self.sampler(logits, self.sampling.build(states))
                sampled, logprobs = result.sampled_token_ids, result.logprobs
        sampled, self._sampled_arrival = broadcast_sampled(
            self.parallel, sampled, len(states), self.device
        )
        return SamplerOutput(sampled, logprobs)

    def _beam_top_k(self, step: _InFlightStep, logits: torch.Tensor) -> None:
        """A step's beam-search rows: each search's best continuations on the device
        (kiln.sampling.beam), copied to the host with the sampled ids. A search whose rows are
        all in this step (the usual case: its forks are admitted together) is one group; one
        split over steps (short of sequence slots or blocks) gets a group a row, and the search
        merges them once its last row is back."""
        rows = step.sched.beam_rows
        searches: dict[str, list[tuple[int, str, BeamRow]]] = {}
        for index, state in enumerate(step.states):
            row = rows.get(state.req_id)
            if row is not None:
                searches.setdefault(row.search_id, []).append((index, state.req_id, row))
        if not searches:
            return
        indices: list[int] = []
        scores: list[float] = []
        groups: list[tuple[int, int]] = []
        owners: list[tuple[str, list[int]]] = []  # (the request that carries a group, its beams)
        for members in searches.values():
            whole = len(members) == members[0][2].num_beams
            for part in [members] if whole else [[m] for m in members]:
                indices += [index for index, _, _ in part]
                scores += [row.score for _, _, row in part]
                groups.append((len(part), part[0][2].keep))
                owners.append((part[0][1], [row.beam for _, _, row in part]))
        if indices == list(range(len(indices))):
            beam_logits = logits[: len(indices)]  # (one search alone in the step: no gather)
        else:
            beam_logits = logits[to_device(indices, torch.long, self.device)]
        step.beam = beam_top_k(beam_logits, to_device(scores, torch.float32, self.device), groups)
        step.beam_owners = owners

    def _beam_candidates(self, step: _InFlightStep) -> dict[str, BeamCandidates]:
        scores, rows, tokens = (t.tolist() for t in step.host_beam)
        out, start = {}, 0
        for (req_id, beams), size in zip(step.beam_owners, step.beam.sizes):
            end = start + size
            out[req_id] = BeamCandidates(
                scores[start:end], [beams[r] for r in rows[start:end]], tokens[start:end]
            )
            start = end
        return out

    def collect(self) -> ModelRunnerOutput:
        """Wait for the oldest submitted step's sampled ids and return them."""
        if self._in_flight[0] is self._deferred:
            self._launch_deferred_sample()
        if self._in_flight[0].output is None:
            self._finish(self._in_flight[0])
        return self._in_flight.popleft().output

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
        buf.input_ids.index_copy_(
            0, buf.pending_dst[:k], self._last_sampled.index_select(0, buf.pending_src[:k])
        )

    def _copy_to_host(self, step: _InFlightStep, logprobs: LogprobsTensors | None) -> None:
        """Start the step's one device->host copy (ids, and logprobs if asked for)."""
        if step.arrival is not None:
            return  # the driver's ids are still on their way: copied in _finish, once waited for
        beam = step.beam
        if self.device.type != "cuda":
            step.host_sampled, step.host_logprobs = step.sampled, logprobs
            if beam is not None:
                step.host_beam = (beam.scores, beam.rows, beam.token_ids)
            return
        self._host_slot ^= 1
        num_ids = step.sampled.shape[0]
        host = self.inputs.sampled_cpu[self._host_slot][:num_ids]
        if num_ids:  # (none: every row verified drafts, whose ids come back in spec_result)
            host.copy_(step.sampled, non_blocking=True)
        step.host_sampled = host
        if logprobs is not None:
            step.host_logprobs = LogprobsTensors(
                *(t.to("cpu", non_blocking=True) for t in _fields(logprobs))
            )
        if beam is not None:
            step.host_beam = tuple(
                t.to("cpu", non_blocking=True) for t in (beam.scores, beam.rows, beam.token_ids)
            )
        step.done = torch.cuda.Event()
        step.done.record()

    def _finish(self, step: _InFlightStep) -> None:
        """Wait for a step's ids and hand them to its requests' states (the one sync)."""
        t4 = time.perf_counter()
        if step.states is None:
            step.output = ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=step.prompt_lp)
            self._record(step, t4, t4, t4)
            self._start_deferred_fill()
            return
        if step.arrival is not None:  # a rank other than the driver: its ids, received
            step.arrival.wait()
            if step.arrival is self._last_arrival:
                self._last_arrival = None
            step.arrival, step.host_sampled = None, step.sampled.cpu()
        if step.done is not None:
            step.done.synchronize()
        t5 = time.perf_counter()
        sampled = step.host_sampled.tolist()
        logprob_rows = None
        if step.host_logprobs is not None:
            logprob_rows = _logprobs_to_lists(step.host_logprobs)
        sampled_ids: dict[str, list[int]] = {}
        for state, token_id in zip(step.states, sampled):
            state.output_token_ids.append(token_id)
            state.token_ids.append(token_id)
            state.num_pending -= 1
            sampled_ids[state.req_id] = [token_id]
        if self._grammars is not None and step.tokens_to_grammar:
            self._grammars.accept_tokens([s.req_id for s in step.states], sampled)
        if step.spec_states:
            self._finish_verification(step, sampled_ids)
        logprobs = {}
        if logprob_rows is not None:
            for i, state in enumerate(step.states):
                n = state.sampling_params.logprobs
                if n is not None:
                    ids, lps, rank = logprob_rows[i]
                    logprobs[state.req_id] = [TokenLogprobs(ids[: n + 1], lps[: n + 1], rank)]
        spec_ids = {}
        if self.proposer is not None:
            # Drafts only for requests without logprobs (their drafts' logprobs are not built)
            # and without a grammar (drafts are not checked against it).
            wanting = [
                s
                for s in (*step.states, *step.spec_states)
                if s.sampling_params.logprobs is None
                and s.sampling_params.guided_decoding is None
                and s.req_id not in step.sched.beam_rows  # (one token each: nothing to draft)
                and s.req_id in self.requests
            ]
            spec_ids = self.proposer.propose(wanting) if wanting else {}
        beams = self._beam_candidates(step) if step.host_beam is not None else {}
        step.output = ModelRunnerOutput(sampled_ids, logprobs, step.prompt_lp, spec_ids, beams)
        self._record(step, t4, t5, time.perf_counter())
        self._start_deferred_fill()  # a later step's mask may be filled from here on

    def _verify(self, step: _InFlightStep, logits: torch.Tensor) -> torch.Tensor:
        """Take the requests that verify drafts out of the step's sampling rows and verify them
        (rejection sampling over their K + 1 rows each); returns the other rows' logits, which
        the ordinary sampler handles exactly as without speculation.

        Nothing here waits for the device: torch.tensor(list, device="cuda") copies from
        pageable memory and synchronises the stream, so the three such copies this made held the
        host until the forward had finished, then left the GPU idle between the small kernels
        after it (inside the verification step's measured GPU time: 1.147x a plain step's)."""
        plain_rows, spec_rows, spec_states, plain_states = [], [], [], []
        row = 0
        for state in step.states:
            n = len(state.spec_token_ids) + 1 if state.spec_token_ids else 1
            if state.spec_token_ids:
                spec_rows.extend(range(row, row + n))
                spec_states.append(state)
            else:
                plain_rows.append(row)
                plain_states.append(state)
            row += n
        step.states, step.spec_states = plain_states, spec_states
        device = logits.device
        # Every row verifies (a batch of speculating decodes): no gather.
        spec_logits = logits[to_device(spec_rows, torch.long, device)] if plain_rows else logits
        drafts = [d for s in spec_states for d in (*s.spec_token_ids, -1)]
        if all(s.plain_greedy for s in spec_states):
            # The common case. A greedy row accepts its draft iff it is the argmax, and emits the
            # argmax where it rejects (or at the bonus row): the argmax ids decide everything,
            # compared with the drafts on the host once they are back (_finish_verification).
            # One kernel and one copy, as a plain decode's sampling.
            greedy = self.sampler.argmax(spec_logits)
            step.spec_result = (None, self._verified_to_host(greedy))
        else:
            rows = verification_rows(spec_states)
            metadata = build_sampling_metadata(rows, self.eos_token_ids, self.vocab_size, device)
            greedy, probs = self.sampler.target_distribution(spec_logits, metadata)
            accepted, recovered = rejection_sample(
                drafts, greedy, probs, metadata.temperature == 0, metadata.generators
            )
            step.spec_result = (
                accepted.to("cpu", non_blocking=True),
                recovered.to("cpu", non_blocking=True),
            )
        step.spec_drafts = drafts
        for state in spec_states:
            state.num_pending += 1
        if not plain_rows:
            return logits[:0]
        return logits[to_device(plain_rows, torch.long, device)]

    def _verified_to_host(self, ids: torch.Tensor) -> torch.Tensor:
        """Start the copy of a greedy verification's ids to the host, into the pinned buffer
        beside the one the step's sampled ids will land in (_copy_to_host takes slot
        _host_slot ^ 1 next, and nothing copies in between): no pinned allocation a step.
        Waited for by the step's `done` event, recorded after."""
        if self.device.type != "cuda":
            return ids
        host = self.inputs.verified_cpu[self._host_slot ^ 1]
        if ids.shape[0] > host.shape[0]:  # cannot happen (a row per token); never truncate
            return ids.to("cpu", non_blocking=True)
        host = host[: ids.shape[0]]
        host.copy_(ids, non_blocking=True)
        return host

    def _finish_verification(self, step: _InFlightStep, sampled_ids: dict[str, list[int]]) -> None:
        accepted, recovered = step.spec_result
        recovered = recovered.tolist()
        if accepted is None:  # greedy rows: accepted where the draft is the argmax (never -1)
            accepted = [d == g for d, g in zip(step.spec_drafts, recovered)]
        else:
            accepted = accepted.tolist()
        num_drafts = [len(s.spec_token_ids) for s in step.spec_states]
        if self.proposer.decides_acceptance:  # the speed benchmark's oracle: its draw decides
            req_ids = [s.req_id for s in step.spec_states]
            accepted = self.proposer.accepted_rows(req_ids, num_drafts)
        emitted = emitted_tokens(num_drafts, step.spec_drafts, accepted, recovered)
        for state, tokens in zip(step.spec_states, emitted):
            state.output_token_ids.extend(tokens)
            state.token_ids.extend(tokens)
            state.num_pending -= 1
            sampled_ids[state.req_id] = tokens

    def _record(self, step: _InFlightStep, t4: float, t5: float, t6: float) -> None:
        if self.step_timing is not None:
            self._record_timing(
                self.step_timing,
                (*step.times, t4, t5, t6),
                step.gpu_events,
                step.graph,
                step.sched,
                step.num_seqs,
            )

    @staticmethod
    def _record_timing(
        timing: dict,
        times: tuple[float, ...],  # perf_counter at the phase boundaries
        gpu_events: tuple | None,
        graph: bool,
        sched: SchedulerOutput,
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
        if gpu_events is not None:  # complete: the step's sync waited for the sampler
            parts["gpu"] = gpu_events[0].elapsed_time(gpu_events[1]) / 1000
        row = [round(parts[n] * 1000, 3) if n in parts else None for n in TRACE_COLUMNS[3:]]
        timing.setdefault("trace", []).append(
            [graph, num_seqs, sched.total_num_scheduled_tokens, *row]
        )
        parts["steps"] = 1
        kind = "graph_" if graph else "eager_"
        for name, value in parts.items():  # totals, and per kind of step
            timing[name] = timing.get(name, 0.0) + value
            timing[kind + name] = timing.get(kind + name, 0.0) + value

    def _prompt_logprobs(
        self, batch: PackedBatch, states: list[CachedRequestState], hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Score prompt tokens for requests that asked: position p's logits predict token p+1.
        Rows go through the vocabulary projection max_num_seqs at a time, so the memory this
        takes never exceeds what the startup profile measured for sampling."""
        out: dict[str, PromptLogprobsChunk] = {}
        if not self._prompt_logprobs_ids or not getattr(self.model, "computes_logits", True):
            return out  # none asked; or an earlier pipeline stage: no logits here
        for r, state in enumerate(states):
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            first = state.num_computed_tokens  # position of this chunk's first token
            last = min(first + batch.num_scheduled[r], len(state.prompt_token_ids) - 1)
            if last <= first:
                continue
            start = int(batch.query_start_loc_np[r])
            entries = []
            for a in range(first, last, self.max_num_seqs):
                b = min(a + self.max_num_seqs, last)
                chunk = hidden[start + a - first : start + b - first]
                logits = self.model.compute_logits(chunk, self.ops)
                targets = torch.tensor(state.prompt_token_ids[a + 1 : b + 1], device=logits.device)
                rows = _logprobs_to_lists(compute_logprobs(logits, targets, num_top))
                entries += [TokenLogprobs(ids, lps, rank) for ids, lps, rank in rows]
            out[state.req_id] = PromptLogprobsChunk(first + 1, entries)
        return out


def _logits_rows(hidden: torch.Tensor, batch: PackedBatch) -> torch.Tensor:
    """The hidden states of the step's logits rows: a view where they lead the batch (decodes;
    verification steps of decodes alone), else a gather."""
    if batch.logits_indices is None:
        return hidden[: batch.num_logits_rows]
    return hidden[batch.logits_indices]


def _fields(t: LogprobsTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return t.token_ids, t.logprobs, t.ranks


def _logprobs_to_lists(t: LogprobsTensors) -> list[tuple[list[int], list[float], int]]:
    return list(zip(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()))


@dataclass(eq=False)
class _InFlightStep:
    """A submitted step until collect() hands its output on."""

    sched: SchedulerOutput
    graph: bool
    num_seqs: int
    prompt_lp: dict[str, PromptLogprobsChunk]
    states: list[CachedRequestState] | None = None  # the rows that sample, in sampled-ids order
    spec_states: list[CachedRequestState] = field(default_factory=list)  # verifying drafts
    spec_drafts: list[int] = field(default_factory=list)  # per verification row (-1: bonus)
    # (accepted, recovered) on the host; accepted None: greedy rows, decided on the host.
    spec_result: tuple[torch.Tensor | None, torch.Tensor] | None = None
    sampled: torch.Tensor | None = None  # [rows] on the device
    arrival: object | None = None  # TP/PP, not the driver: the pending receive of `sampled`
    host_sampled: torch.Tensor | None = None
    host_logprobs: LogprobsTensors | None = None
    done: torch.cuda.Event | None = None  # the host copies have landed
    gpu_events: tuple | None = None
    times: tuple[float, ...] = ()
    output: ModelRunnerOutput | None = None
    deferred: tuple | None = None  # (logits, gpu_events, metadata) while it waits for a mask
    pending_mask: object | None = None  # kiln.structured_output.PendingBitmask once started
    # False once a later step's grammar fill took this step's ids from its host copy itself.
    tokens_to_grammar: bool = True
    beam: BeamTopK | None = None  # beam-search rows' best continuations (device)
    beam_owners: list[tuple[str, list[int]]] = field(default_factory=list)  # per group
    host_beam: tuple[torch.Tensor, ...] | None = None  # beam's tensors, on the host


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
