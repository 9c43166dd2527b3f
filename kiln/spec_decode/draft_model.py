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

import torch

from kiln.attention.backend import AttentionMetadata, get_attention_backend
from kiln.kernels.ops import kernel_ops, resolve_kernel_backend
from kiln.models.llama import LlamaForCausalLM
from kiln.spec_decode.proposer import DraftRequest, Proposer


@dataclass
class _DraftState:
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V the draft's cache holds


class DraftModelProposer(Proposer):
    def __init__(
        self,
        model: LlamaForCausalLM,
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
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = model.norm.device
        kernels = resolve_kernel_backend(attention_backend, self.device)
        self.ops = kernel_ops(kernels)
        self.backend = get_attention_backend(kernels, self.device)
        cfg = model.config
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        dtype = kv_cache_dtype or model.norm.dtype
        self.kv_caches = [
            (
                torch.zeros(shape, dtype=dtype, device=self.device),
                torch.zeros(shape, dtype=dtype, device=self.device),
            )
            for _ in range(cfg.num_hidden_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))
        self.states: dict[str, _DraftState] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self._free.extend(reversed(state.blocks))

    def _reserve(self, state: _DraftState, num_positions: int) -> bool:
        need = -(-num_positions // self.block_size) - len(state.blocks)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            state.blocks.append(self._free.pop())
        return True

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
            if self._reserve(state, n + k - 1):
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
        bs, dev = self.block_size, self.device
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        width = max(len(s.blocks) for _, s in batch)
        table = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, ((_, state), chunk, start) in enumerate(zip(batch, chunks, starts)):
            table[row, : len(state.blocks)] = torch.tensor(state.blocks, dtype=torch.int32)
            for i, token in enumerate(chunk):
                p = start + i
                ids.append(token)
                pos.append(p)
                slots.append(state.blocks[p // bs] * bs + p % bs)
            qsl.append(qsl[-1] + len(chunk))
            seq_lens.append(start + len(chunk))
        query_lens = [len(c) for c in chunks]
        num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens))
        metadata = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
        hidden = self.model(
            self.ops,
            self.backend,
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(pos, dtype=torch.int64, device=dev),
            self.kv_caches,
            metadata,
        )
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.int64, device=dev)
        return self.ops.argmax(self.model.compute_logits(hidden[last])).tolist()
