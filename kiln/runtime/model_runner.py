"""The data plane: execute(SchedulerOutput) -> ModelRunnerOutput.

Keeps a per-request copy of tokens and block tables, packs each step into persistent buffers, runs
the model over the paged KV cache (a CUDA graph for decode-only steps, eager otherwise), samples on
the device, and returns plain Python values to the scheduler. One device->host sync per step: the
sampled token ids (plus logprobs when asked for, in the same sync).
"""

from __future__ import annotations

import logging
import time

import torch

from kiln.attention.backend import get_attention_backend
from kiln.engine.scheduler import (
    ModelRunnerOutput,
    PromptLogprobsChunk,
    SchedulerOutput,
    TokenLogprobs,
)
from kiln.kernels.ops import kernel_ops
from kiln.models.llama import LlamaForCausalLM
from kiln.runtime.graph_runner import GraphRunner
from kiln.runtime.input_batch import CachedRequestState, InputBuffers, PackedBatch
from kiln.sampling.sampler import LogprobsTensors, Sampler, compute_logprobs
from kiln.sampling.sampling_metadata import SamplingMetadataBuilder

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
        model: LlamaForCausalLM,
        num_kv_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        attention_backend: str = "auto",
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.model = model
        cfg = model.config
        self.device = model.norm.device
        self.dtype = model.norm.dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len or model.cos_sin_cache.shape[0]
        self.ops = kernel_ops(self.device)
        self.backend = get_attention_backend(attention_backend, self.device)
        shape = (num_kv_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        # Zeroed, not empty: padded block-table entries are read (and masked) by the reference
        # decode path, and masked garbage can still be NaN.
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self.inputs = InputBuffers(
            max_num_batched_tokens, max_num_seqs, self.max_model_len, block_size, self.device
        )
        self.sampler = Sampler()
        self.sampling = SamplingMetadataBuilder(eos_token_ids, self.vocab_size, self.device)
        self.requests: dict[str, CachedRequestState] = {}
        self.graphs: GraphRunner | None = None
        if self.device.type == "cuda" and not enforce_eager and self.backend.supports_cuda_graphs:
            self.graphs = GraphRunner(
                model,
                self.ops,
                self.backend,
                self.kv_caches,
                self.inputs,
                max_num_seqs,
                self.max_model_len,
            )
            self.graphs.capture()
        self.step_timing: dict[str, float] | None = None  # set to {} to collect host timings
        self.last_step_used_graph = False

    def enable_fake_graphs(self) -> None:
        """Use FakeGraph (CPU) decode graphs: exercises padding and bucketing without CUDA."""
        self.graphs = GraphRunner(
            self.model,
            self.ops,
            self.backend,
            self.kv_caches,
            self.inputs,
            self.max_num_seqs,
            self.max_model_len,
            fake=True,
        )
        self.graphs.capture()

    # ---- state -------------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                self.inputs.remove_request(state.row)
        for new in sched.new_requests:
            old = self.requests.pop(new.req_id, None)
            if old is not None:
                self.inputs.remove_request(old.row)
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
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            if cached.new_block_ids:
                self.inputs.append_blocks(state.row, len(state.block_ids), cached.new_block_ids)
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        timing = self.step_timing
        t0 = time.perf_counter()
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        # Decodes (one token) first: the attention backend takes them as one batched call.
        scheduled = sched.num_scheduled_tokens
        req_ids = [r for r, n in scheduled.items() if n == 1]
        num_decodes = len(req_ids)
        if num_decodes < len(scheduled):
            req_ids += [r for r, n in scheduled.items() if n != 1]
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [scheduled[r] for r in req_ids]

        graph_key = None
        if self.graphs is not None and num_decodes == len(req_ids):
            max_seq_len = max(s.num_computed_tokens for s in states) + 1
            graph_key = self.graphs.lookup(len(states), max_seq_len)
        batch = self.inputs.prepare(states, num_scheduled, graph_key and graph_key[0])
        self.last_step_used_graph = graph_key is not None
        t1 = time.perf_counter()
        gpu_events = None
        if timing is not None and self.device.type == "cuda":
            gpu_events = tuple(torch.cuda.Event(enable_timing=True) for _ in range(2))
            gpu_events[0].record()
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
        prompt_logprobs = self._prompt_logprobs(batch, states, hidden)
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        if not batch.sampling_rows:
            if timing is not None:  # a step of prompt chunks only: no sampling, no sync
                t2 = time.perf_counter()
                times = (t0, t1, t2, t2, t2, t2)
                self._record_timing(timing, times, None, graph_key is not None, sched, len(states))
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs)

        sampling_states = [states[r] for r in batch.sampling_rows]
        num_rows = len(sampling_states)
        if batch.logits_indices is None:
            logits = self.model.compute_logits(hidden[:num_rows])
        else:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
        metadata = self.sampling.build(sampling_states)
        result = self.sampler(logits, metadata)
        if gpu_events is not None:
            gpu_events[1].record()
        t3 = time.perf_counter()
        sampled, logprob_rows = self._to_host(result.sampled_token_ids, result.logprobs)
        t4 = time.perf_counter()
        sampled_ids: dict[str, int] = {}
        for state, token_id in zip(sampling_states, sampled):
            state.output_token_ids.append(token_id)
            state.token_ids.append(token_id)
            sampled_ids[state.req_id] = token_id
        logprobs = {}
        if logprob_rows is not None:
            for i, state in enumerate(sampling_states):
                n = state.sampling_params.logprobs
                if n is not None:
                    ids, lps, rank = logprob_rows[i]
                    logprobs[state.req_id] = TokenLogprobs(ids[: n + 1], lps[: n + 1], rank)
        if timing is not None:
            times = (t0, t1, t2, t3, t4, time.perf_counter())
            self._record_timing(
                timing, times, gpu_events, graph_key is not None, sched, len(states)
            )
        return ModelRunnerOutput(sampled_ids, logprobs, prompt_logprobs)

    @staticmethod
    def _record_timing(
        timing: dict,
        times: tuple[float, ...],  # perf_counter at the phase boundaries (TRACE_COLUMNS[3:8])
        gpu_events: tuple | None,
        graph: bool,
        sched: SchedulerOutput,
        num_seqs: int,
    ) -> None:
        parts = {name: b - a for name, a, b in zip(TRACE_COLUMNS[3:8], times, times[1:])}
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

    def _to_host(
        self, sampled: torch.Tensor, logprobs: LogprobsTensors | None
    ) -> tuple[list[int], list[tuple[list[int], list[float], int]] | None]:
        """The step's one sync: sampled ids (and logprobs) copied out, then waited for once."""
        if self.device.type != "cuda":
            rows = None if logprobs is None else _logprobs_to_lists(logprobs)
            return sampled.tolist(), rows
        n = sampled.shape[0]
        host = self.inputs.sampled_cpu[:n]
        host.copy_(sampled, non_blocking=True)
        host_logprobs = None
        if logprobs is not None:
            host_logprobs = LogprobsTensors(
                *(t.to("cpu", non_blocking=True) for t in (*_fields(logprobs),))
            )
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        rows = None if host_logprobs is None else _logprobs_to_lists(host_logprobs)
        return host.tolist(), rows

    def _prompt_logprobs(
        self, batch: PackedBatch, states: list[CachedRequestState], hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Score prompt tokens for requests that asked: position p's logits predict token p+1.
        Rows go through the vocabulary projection max_num_seqs at a time, so the memory this
        takes never exceeds what the startup profile measured for sampling."""
        out: dict[str, PromptLogprobsChunk] = {}
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
                logits = self.model.compute_logits(hidden[start + a - first : start + b - first])
                targets = torch.tensor(state.prompt_token_ids[a + 1 : b + 1], device=logits.device)
                rows = _logprobs_to_lists(compute_logprobs(logits, targets, num_top))
                entries += [TokenLogprobs(ids, lps, rank) for ids, lps, rank in rows]
            out[state.req_id] = PromptLogprobsChunk(first + 1, entries)
        return out


def _fields(t: LogprobsTensors) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return t.token_ids, t.logprobs, t.ranks


def _logprobs_to_lists(t: LogprobsTensors) -> list[tuple[list[int], list[float], int]]:
    return list(zip(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()))
