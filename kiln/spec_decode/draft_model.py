"""Draft-model proposer: a smaller model of the same vocabulary drafts K tokens greedily.

The draft keeps its own paged KV pool (as many blocks as the target's, planned together in
kiln.runtime.memory_plan) with its own block tables: per request, the tokens whose K/V it holds.
Each propose() first runs the draft over the request's tokens it has not seen (the whole prompt
the first time, then the step's accepted tokens and bonus: one forward for the whole batch), then
K - 1 one-token decodes of its own drafts. Draft positions are written into its cache but not
counted as computed, so the next call overwrites them with the tokens the target kept.

Greedy drafts are a one-hot proposal distribution, which the rejection sampler verifies exactly
for greedy and random requests alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from kiln.attention.backend import get_attention_backend
from kiln.kernels.ops import kernel_ops, resolve_kernel_backend
from kiln.models.base import CausalLM
from kiln.sampling.host_copy import to_device
from kiln.spec_decode.kv_pool import DraftKVPool
from kiln.spec_decode.proposer import DraftRequest, Proposer


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V the draft's cache holds


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: CausalLM,
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        kv_cache_dtype: torch.dtype | None = None,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        self.model = model
        self.max_num_batched_tokens = max_num_batched_tokens
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.device = model.device
        kernels = resolve_kernel_backend(attention_backend, self.device)
        self.ops = kernel_ops(kernels)
        self.backend = get_attention_backend(kernels, self.device)
        cfg, dtype = model.config, kv_cache_dtype or model.dtype
        self.pool = DraftKVPool(
            cfg, cfg.num_hidden_layers, num_blocks, block_size, dtype, self.device
        )
        self.states: dict[str, _DraftState] = {}

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.pool.release(state.blocks)

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        k = self.num_speculative_tokens
        batch: list[tuple[DraftRequest, _DraftState]] = []
        for request in requests:
            n = len(request.token_ids)
            if n + 1 > self.max_model_len:
                continue
            state = self.states.setdefault(request.req_id, _DraftState())
            state.num_computed = min(state.num_computed, n - 1)  # always recompute the last token
            # Positions up to n + k - 2 are written (the last draft is never fed back).
            if self.pool.reserve(state.blocks, n + k - 1):
                batch.append((request, state))
        if not batch:
            return {}
        self._catch_up(batch)
        # Now one token each (the last known one): a decode batch.
        chunks = [r.token_ids[s.num_computed :] for r, s in batch]
        starts = [s.num_computed for _, s in batch]
        drafts = [[t] for t in self._forward(batch, chunks, starts)]
        for request, state in batch:
            state.num_computed = len(request.token_ids)
        for j in range(1, k):
            last = [[d[-1]] for d in drafts]
            positions = [len(r.token_ids) + j - 1 for r, _ in batch]
            for d, t in zip(drafts, self._forward(batch, last, positions)):
                d.append(t)
        return {r.req_id: d for (r, _), d in zip(batch, drafts)}

    def _catch_up(self, batch: list[tuple[DraftRequest, _DraftState]]) -> None:
        """Run the draft over every token it has not seen but the last, at most
        `max_num_batched_tokens` a forward (a new request's whole prompt, in chunks), so no
        draft pass is larger than a step the memory plan profiled."""
        while True:
            group, chunks, starts, budget = [], [], [], self.max_num_batched_tokens
            for request, state in batch:
                todo = len(request.token_ids) - 1 - state.num_computed
                if todo <= 0 or budget <= 0:
                    continue
                take = min(todo, budget)
                group.append((request, state))
                chunks.append(request.token_ids[state.num_computed : state.num_computed + take])
                starts.append(state.num_computed)
                budget -= take
            if not group:
                return
            # One-token queries first: the attention backend takes the decodes as a block.
            order = sorted(range(len(group)), key=lambda i: len(chunks[i]) != 1)
            self._forward(
                [group[i] for i in order], [chunks[i] for i in order], [starts[i] for i in order]
            )
            for (_, state), chunk in zip(group, chunks):
                state.num_computed += len(chunk)

    def _forward(
        self,
        batch: list[tuple[DraftRequest, _DraftState]],
        chunks: list[list[int]],  # each sequence's query tokens
        starts: list[int],  # position of each chunk's first token
    ) -> list[int]:  # the draft's argmax after each chunk's last token
        dev = self.device
        ids = [t for chunk in chunks for t in chunk]
        pos = [p for chunk, start in zip(chunks, starts) for p in range(start, start + len(chunk))]
        query_lens = [len(c) for c in chunks]
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        metadata = self.pool.attention_metadata(
            [s.blocks for _, s in batch], starts, query_lens, num_decodes
        )
        hidden = self.model(
            self.ops,
            self.backend,
            to_device(ids, torch.int64, dev),
            to_device(pos, torch.int64, dev),
            self.pool.kv_caches,
            metadata,
        )
        last = to_device([e - 1 for e in accumulate(query_lens)], torch.int64, dev)
        return self.ops.argmax(self.model.compute_logits(hidden[last], self.ops)).tolist()
