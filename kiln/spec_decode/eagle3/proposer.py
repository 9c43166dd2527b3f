"""The EAGLE-3 proposer: the head drafts from the target's own hidden states, then its own.

Per request the head keeps a paged KV pool of its one layer (as many blocks as the target's,
planned together in kiln.runtime.memory_plan) and the fused target states of the positions the
target computed that it has not consumed yet. Every target forward hands the proposer its rows
of low/middle/high states (`record_target_hidden_states`, fused by `fc` at once, one matmul a
step); `propose` then, once the step's tokens are known,

1. runs the head over every verified position it has not seen, p in [seen, N - 1) for a request
   of N known tokens (position p: the embedding of token p + 1 and the target's state at p),
   one forward for the batch (a new prompt in chunks of the step budget);
2. takes its argmax at position N - 2 as the first draft (the token at N), and
3. chains K - 1 one-token steps at positions N - 1, N, ..., each on the previous draft's
   embedding and the head's own pre-norm output at the position before.

Chained positions are written into the head's cache but not counted as seen: the next call
overwrites them with the target's states for the tokens the verification kept, and states the
target computed for rejected drafts are dropped. Positions the target took from the prefix
cache (no hidden states) are skipped: the head's context then starts at the first position the
target computed, which costs acceptance, not exactness.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from kiln.attention.backend import get_attention_backend
from kiln.kernels.ops import kernel_ops, resolve_kernel_backend
from kiln.sampling.host_copy import to_device
from kiln.spec_decode.eagle3.head import Eagle3Head
from kiln.spec_decode.kv_pool import DraftKVPool
from kiln.spec_decode.proposer import DraftRequest, Proposer


@dataclass
class _HeadState:
    blocks: list[int] = field(default_factory=list)
    first: int | None = None  # the first position the head holds (its slot 0)
    num_seen: int = 0  # positions < this are in the head's cache, from target states
    pending_start: int = 0  # position of pending's first row
    pending: list[torch.Tensor] = field(default_factory=list)  # fused target states, in order

    def num_pending(self) -> int:
        return sum(t.shape[0] for t in self.pending)


class Eagle3Proposer(Proposer):
    uses_target_hidden_states = True

    def __init__(
        self,
        head: Eagle3Head,
        embedding: torch.nn.Module,  # the head's own, or the target's
        num_speculative_tokens: int,
        num_blocks: int,
        block_size: int,
        max_model_len: int,
        attention_backend: str = "auto",
        kv_cache_dtype: torch.dtype | None = None,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        self.head, self.embedding = head, embedding
        self.num_speculative_tokens = num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = head.norm.device
        kernels = resolve_kernel_backend(attention_backend, self.device)
        self.ops = kernel_ops(kernels)
        self.backend = get_attention_backend(kernels, self.device)
        dtype = kv_cache_dtype or head.norm.dtype
        self.pool = DraftKVPool(head.config, 1, num_blocks, block_size, dtype, self.device)
        self.states: dict[str, _HeadState] = {}

    def remove(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.pool.release(state.blocks)

    # ---- the target's side: its hidden states, every step ------------------------------------

    @torch.inference_mode()
    def record_target_hidden_states(
        self,
        requests: Sequence,  # the step's CachedRequestStates, in row order
        num_scheduled: Sequence[int],
        query_start_loc: np.ndarray,  # [len(requests) + 1]: each request's first row
        aux_hidden_states: torch.Tensor,  # [>= rows, 3 * target_hidden] (the target's buffer)
    ) -> None:
        """Keep the fused states of the positions each request computed this step (before its
        num_computed_tokens moves past them). Requests that get no drafts are skipped."""
        rows = [
            r
            for r, s in enumerate(requests)
            if s.sampling_params.logprobs is None and s.sampling_params.guided_decoding is None
        ]
        if not rows:
            return
        fused = self.head.fuse(self.ops, aux_hidden_states[: int(query_start_loc[len(requests)])])
        for r in rows:
            request, n = requests[r], num_scheduled[r]
            state = self.states.setdefault(request.req_id, _HeadState())
            start = request.num_computed_tokens
            keep = start - state.pending_start
            if not state.pending or keep < 0 or keep > state.num_pending():
                state.pending, state.pending_start = [], start  # a fresh run of positions
            else:  # positions from `start` on were rejected drafts' (or are recomputed): drop
                state.pending = _take_rows(state.pending, keep)
            row = int(query_start_loc[r])
            state.pending.append(fused[row : row + n])

    # ---- drafting ----------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        k = self.num_speculative_tokens
        work: list[tuple[DraftRequest, _HeadState, int]] = []  # (request, state, end)
        for request in requests:
            state = self.states.get(request.req_id)
            end = len(request.token_ids) - 1  # the target has states for positions < end
            if state is None or not state.pending or end + k > self.max_model_len:
                continue
            if state.first is None:  # the first positions the target computed for it
                state.first = state.num_seen = state.pending_start
            if (
                not state.pending_start
                <= state.num_seen
                < end
                <= (state.pending_start + state.num_pending())
            ):
                continue  # nothing new verified (or states missing): no drafts this step
            # Slots up to end + k - 2 are written (the last draft is never fed back).
            if self.pool.reserve(state.blocks, end + k - 1 - state.first):
                work.append((request, state, end))
        if not work:
            return {}
        normed, prenorm = self._catch_up(work)
        # The chain stays on the device (each draft feeds the next step as a tensor): one copy
        # to the host at the end, not one sync per draft.
        drafts = [self.head.draft_token_ids(self.ops, normed)]
        states = [s for _, s, _ in work]
        for j in range(1, k):
            # One token each, on the device.
            chunks: list[tuple[Sequence[int], int]] = [((0,), end + j - 1) for _, _, end in work]
            normed, prenorm = self._forward(
                states, chunks, prenorm, num_decodes=len(work), input_ids=drafts[-1]
            )
            drafts.append(self.head.draft_token_ids(self.ops, normed))
        rows = torch.stack(drafts, dim=1).tolist()  # [requests, K]
        return {r.req_id: d for (r, _, _), d in zip(work, rows)}

    def _catch_up(
        self, work: list[tuple[DraftRequest, _HeadState, int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each request's last position: (normed, prenorm)
        """The head over each request's verified, unseen positions, at most
        `max_num_batched_tokens` a forward (a new prompt in chunks)."""
        last_normed: list[torch.Tensor | None] = [None] * len(work)
        last_prenorm: list[torch.Tensor | None] = [None] * len(work)
        while True:
            index, states, chunks, hidden, budget = [], [], [], [], self.max_num_batched_tokens
            for i, (request, state, end) in enumerate(work):
                take = min(end - state.num_seen, budget)
                if take <= 0:
                    continue
                a = state.num_seen
                index.append(i)
                states.append(state)
                chunks.append((request.token_ids[a + 1 : a + 1 + take], a))
                hidden.append(_rows(state.pending, a - state.pending_start, take))
                budget -= take
            if not index:
                break
            # One-token queries first: the attention backend takes the decodes as a block.
            order = sorted(range(len(index)), key=lambda i: len(chunks[i][0]) != 1)
            num_decodes = sum(len(chunks[i][0]) == 1 for i in order)
            normed, prenorm = self._forward(
                [states[i] for i in order],
                [chunks[i] for i in order],
                torch.cat([hidden[i] for i in order]),
                num_decodes,
            )
            offset = 0
            for i in order:
                ids, start = chunks[i]
                state = states[i]
                state.num_seen = start + len(ids)
                offset += len(ids)
                if state.num_seen == work[index[i]][2]:
                    last_normed[index[i]] = normed[offset - 1]
                    last_prenorm[index[i]] = prenorm[offset - 1]
        for _, state, _ in work:  # consumed; what is past `end` was rejected drafts'
            state.pending, state.pending_start = [], state.num_seen
        # Every request's catch-up reaches its `end`, which filled its row.
        normed_rows = cast("list[torch.Tensor]", last_normed)
        prenorm_rows = cast("list[torch.Tensor]", last_prenorm)
        return torch.stack(normed_rows), torch.stack(prenorm_rows)

    def _forward(
        self,
        states: list[_HeadState],
        chunks: list[tuple[Sequence[int], int]],  # per sequence: (input ids, first position)
        hidden: torch.Tensor,  # [num_tokens, hidden], in chunk order
        num_decodes: int,  # the leading chunks of one token
        input_ids: torch.Tensor | None = None,  # on the device already (chunks give lengths)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dev = self.device
        ids = [t for chunk, _ in chunks for t in chunk]
        pos = [p for chunk, start in chunks for p in range(start, start + len(chunk))]
        metadata = self.pool.attention_metadata(
            [s.blocks for s in states],
            # The head's context starts at its first position (slot 0), set by propose.
            [start - cast(int, s.first) for s, (_, start) in zip(states, chunks)],
            [len(chunk) for chunk, _ in chunks],
            num_decodes,
        )
        if input_ids is None:
            input_ids = to_device(ids, torch.int64, dev)  # pinned: no wait for the stream
        return self.head(
            self.ops,
            self.backend,
            self.embedding,
            input_ids,
            to_device(pos, torch.int64, dev),
            hidden,
            self.pool.kv_caches[0],  # the midlayer's
            metadata,
        )


def _take_rows(chunks: list[torch.Tensor], n: int) -> list[torch.Tensor]:
    """The first n rows of the concatenated chunks, as chunks."""
    out = []
    for chunk in chunks:
        if n <= 0:
            break
        out.append(chunk[:n])
        n -= chunk.shape[0]
    return out


def _rows(chunks: list[torch.Tensor], start: int, n: int) -> torch.Tensor:
    """Rows start .. start + n of the concatenated chunks."""
    return torch.cat(chunks)[start : start + n] if len(chunks) > 1 else chunks[0][start : start + n]
