"""The data plane: execute(SchedulerOutput) -> ModelRunnerOutput.

Keeps a per-request copy of tokens and block tables, packs each step, runs the model over the
paged KV cache, samples, and returns plain Python values to the scheduler.
"""

from __future__ import annotations

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
from kiln.runtime.input_batch import CachedRequestState, PackedBatch, build_packed_batch
from kiln.sampling.sampler import LogprobsTensors, Sampler, compute_logprobs
from kiln.sampling.sampling_metadata import build_sampling_metadata


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_kv_blocks: int,
        block_size: int,
        eos_token_ids: tuple[int, ...],
        attention_backend: str = "auto",
    ) -> None:
        self.model = model
        cfg = model.config
        self.device = model.norm.device
        self.dtype = model.norm.dtype
        self.block_size = block_size
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = eos_token_ids
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
        self.sampler = Sampler()
        self.requests: dict[str, CachedRequestState] = {}

    # ---- state -------------------------------------------------------------------------------

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.new_requests:
            self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id,
                prompt_token_ids=new.prompt_token_ids,
                output_token_ids=list(new.output_token_ids),
                sampling_params=new.sampling_params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
        for cached in sched.cached_requests:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step ----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput(sampled_token_ids={})
        # Decodes (one token) first: the attention backend takes them as one batched call.
        req_ids = sorted(
            sched.num_scheduled_tokens, key=lambda r: sched.num_scheduled_tokens[r] != 1
        )
        states = [self.requests[r] for r in req_ids]
        num_scheduled = [sched.num_scheduled_tokens[r] for r in req_ids]
        batch = build_packed_batch(states, num_scheduled, self.block_size, self.device)
        hidden = self.model(
            self.ops,
            self.backend,
            batch.input_ids,
            batch.positions,
            self.kv_caches,
            batch.metadata,
        )
        prompt_logprobs = self._prompt_logprobs(batch, states, hidden)
        for state, n in zip(states, num_scheduled):
            state.num_computed_tokens += n
        if not batch.sampling_rows:
            return ModelRunnerOutput(sampled_token_ids={}, prompt_logprobs=prompt_logprobs)

        sampling_states = [states[r] for r in batch.sampling_rows]
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        metadata = build_sampling_metadata(
            sampling_states, self.eos_token_ids, self.vocab_size, self.device
        )
        result = self.sampler(logits, metadata)
        sampled = result.sampled_token_ids.tolist()
        sampled_ids: dict[str, int] = {}
        for state, token_id in zip(sampling_states, sampled):
            state.output_token_ids.append(token_id)
            state.token_ids.append(token_id)
            sampled_ids[state.req_id] = token_id
        logprobs = {}
        if result.logprobs is not None:
            rows = _logprobs_to_lists(result.logprobs)
            for i, state in enumerate(sampling_states):
                n = state.sampling_params.logprobs
                if n is not None:
                    ids, lps, rank = rows[i]
                    logprobs[state.req_id] = TokenLogprobs(ids[: n + 1], lps[: n + 1], rank)
        return ModelRunnerOutput(sampled_ids, logprobs, prompt_logprobs)

    def _prompt_logprobs(
        self, batch: PackedBatch, states: list[CachedRequestState], hidden: torch.Tensor
    ) -> dict[str, PromptLogprobsChunk]:
        """Score prompt tokens for requests that asked: position p's logits predict token p+1."""
        out: dict[str, PromptLogprobsChunk] = {}
        for r, state in enumerate(states):
            num_top = state.sampling_params.prompt_logprobs
            if num_top is None:
                continue
            first = state.num_computed_tokens  # position of this chunk's first token
            last = min(first + batch.num_scheduled[r], len(state.prompt_token_ids) - 1)
            if last <= first:
                continue
            start = batch.query_start_loc_cpu[r]
            logits = self.model.compute_logits(hidden[start : start + last - first])
            targets = torch.tensor(
                state.prompt_token_ids[first + 1 : last + 1], device=logits.device
            )
            rows = _logprobs_to_lists(compute_logprobs(logits, targets, num_top))
            entries = [TokenLogprobs(ids, lps, rank) for ids, lps, rank in rows]
            out[state.req_id] = PromptLogprobsChunk(first + 1, entries)
        return out


def _logprobs_to_lists(t: LogprobsTensors) -> list[tuple[list[int], list[float], int]]:
    return list(zip(t.token_ids.tolist(), t.logprobs.tolist(), t.ranks.tolist()))
