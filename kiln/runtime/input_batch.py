"""Packs one step's scheduled tokens into flat tensors (no padding) for the model.

The buffers persist across steps: host arrays (pinned on CUDA, so copies are asynchronous) are
filled with numpy, copied once into device tensors of fixed address, and the model reads views of
those. Fixed addresses are what CUDA graphs need; pinned memory is what lets the host run ahead of
the GPU. Each request keeps a row of a persistent host block table, so a step gathers block ids
with one numpy index instead of converting Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from kiln.attention.backend import AttentionMetadata
from kiln.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The runner's copy of a request: enough to build inputs and sample, nothing more."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    row: int = -1  # its row in InputBuffers' persistent block table (set by the runner)
    # Sampled in steps whose ids are not back on the host yet (async scheduling: at most 2), and
    # where the latest sits in its step's sampled-ids tensor on the device.
    num_pending: int = 0
    pending_index: int = -1
    pending_step: int = 0  # which of the runner's sampling steps holds the pending token
    token_ids: list[int] = field(init=False)
    plain_greedy: bool = field(init=False)
    """Greedy with nothing else to do (no penalties, logprobs or min_tokens): argmax alone."""
    needs_history: bool = field(init=False)
    """Sampling reads every generated token (penalties), not just how many there are."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Drafts this step verifies (speculative decoding): input tokens after the last known one."""

    def __post_init__(self) -> None:
        self.token_ids = [*self.prompt_token_ids, *self.output_token_ids]
        p = self.sampling_params
        self.needs_history = p.uses_penalties
        self.plain_greedy = (
            p.greedy and not self.needs_history and p.logprobs is None and p.min_tokens == 0
        )

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host, plus those sampled on the device and not yet back."""
        return len(self.token_ids) + self.num_pending

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending


@dataclass(frozen=True)
class PackedBatch:
    req_ids: list[str]  # batch order: decodes (one token) first, then prefill chunks
    num_scheduled: list[int]  # tokens of each request this step, batch order
    input_ids: torch.Tensor  # [num_tokens (padded)] int64
    positions: torch.Tensor  # [num_tokens (padded)] int64
    metadata: AttentionMetadata  # unpadded: num_seqs real sequences
    query_start_loc_np: np.ndarray  # [num_seqs + 1] host copy
    sampling_rows: list[int]  # batch indices of requests that sample this step
    logits_indices: torch.Tensor | None  # [len(sampling_rows)]; None: row i samples at token i
    num_padded_seqs: int  # num_seqs rounded up to a CUDA-graph batch size (= num_seqs if eager)
    # Input tokens still on the device (sampled by the previous step, async scheduling): the
    # runner copies them into input_ids from that step's ids (InputBuffers.pending_src/dst).
    num_pending_inputs: int = 0


class InputBuffers:
    """Persistent host and device buffers for one step's inputs (see the module docstring)."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.device = device
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max(max_num_tokens, max_num_seqs)  # a padded decode batch fits
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        pin = device.type == "cuda"
        t, s, w = self.max_num_tokens, max_num_seqs, self.max_blocks_per_seq

        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        def dev(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.input_ids_cpu = host(t, torch.int64)
        self.positions_cpu = host(t, torch.int64)
        self.slot_mapping_cpu = host(t, torch.int64)
        self.seq_lens_cpu = host(s, torch.int32)
        self.query_start_loc_cpu = host(s + 1, torch.int32)
        self.block_table_cpu = host(s * w, torch.int32)  # compact [num_seqs, num_cols] prefix
        self.logits_indices_cpu = host(t, torch.int64)  # t: a row per verified draft too
        # The step's one device->host copy lands here; two, since with async scheduling a step's
        # ids are copied while the previous step's are still being read.
        self.sampled_cpu = (host(s, torch.int64), host(s, torch.int64))
        self.pending_dst_cpu = host(s, torch.int64)  # input_ids positions to fill on the device
        self.pending_src_cpu = host(s, torch.int64)  # ... from these rows of the last sampled ids

        self.input_ids = dev(t, torch.int64)
        self.positions = dev(t, torch.int64)
        self.slot_mapping = dev(t, torch.int64)
        self.seq_lens = dev(s, torch.int32)
        self.query_start_loc = dev(s + 1, torch.int32)
        self.block_tables = dev((s, w), torch.int32)  # the kernels' table: row stride w
        self.block_table_staging = dev(s * w, torch.int32)
        self.logits_indices = dev(t, torch.int64)
        self.pending_dst = dev(s, torch.int64)
        self.pending_src = dev(s, torch.int64)

        # numpy views of the host buffers (same memory).
        self._ids = self.input_ids_cpu.numpy()
        self._pos = self.positions_cpu.numpy()
        self._slots = self.slot_mapping_cpu.numpy()
        self._seq_lens = self.seq_lens_cpu.numpy()
        self._qsl = self.query_start_loc_cpu.numpy()
        self._bt = self.block_table_cpu.numpy()
        self._logits_idx = self.logits_indices_cpu.numpy()
        self._pending_dst = self.pending_dst_cpu.numpy()
        self._pending_src = self.pending_src_cpu.numpy()

        # Each live request's block ids, one persistent row each.
        self.req_block_table = np.zeros((s, w), dtype=np.int32)
        self._free_rows = list(range(s - 1, -1, -1))
        self._copies_done = torch.cuda.Event() if pin else None
        self._copies_pending = False

    # ---- per-request rows --------------------------------------------------------------------

    def add_request(self, block_ids: list[int]) -> int:
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests in the runner")
        row = self._free_rows.pop()
        self.req_block_table[row, : len(block_ids)] = block_ids
        return row

    def append_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        if block_ids:
            self.req_block_table[row, start : start + len(block_ids)] = block_ids

    def remove_request(self, row: int) -> None:
        self._free_rows.append(row)

    # ---- one step ----------------------------------------------------------------------------

    def wait_for_copies(self) -> None:
        """The host buffers are about to be rewritten: the last step's copies must have read them.
        (Normally done: they were queued before the last step's forward, and the host has since
        waited for the step before that.)"""
        if self._copies_pending:
            self._copies_done.synchronize()
            self._copies_pending = False

    def prepare(
        self,
        states: list[CachedRequestState],  # in batch order: decodes first
        num_scheduled: list[int],
        num_padded_seqs: int | None = None,  # decode-only: pad to this many one-token rows
        flatten: bool = False,  # verification steps: every token an attention row of its own
    ) -> PackedBatch:
        self.wait_for_copies()
        n = len(states)
        query_lens = np.asarray(num_scheduled, dtype=np.int64)
        qsl = self._qsl
        qsl[0] = 0
        np.cumsum(query_lens, out=qsl[1 : n + 1])
        num_tokens = int(qsl[n])
        start = np.fromiter((s.num_computed_tokens for s in states), np.int64, n)
        seq_lens = start + query_lens
        decode_only = num_tokens == n
        seq_of_token, positions, num_pending = self._fill_input_ids(
            states, num_scheduled, start, decode_only
        )

        num_cols = -(-int(seq_lens.max()) // self.block_size)
        query_start_loc_np = qsl[: n + 1].copy()
        if flatten:
            return self._prepare_flat(
                states, num_scheduled, seq_of_token, positions, seq_lens, num_cols,
                num_padded_seqs, num_pending, query_start_loc_np,
            )  # fmt: skip
        padded = n if num_padded_seqs is None else num_padded_seqs
        assert padded == n or decode_only, "only decode-only steps are padded"
        self._fill_positions_and_slots(
            states, seq_of_token, positions, seq_lens, num_cols, num_tokens, padded
        )
        sampling_rows, logits_indices = self._sampling_rows(states, seq_lens, decode_only)
        self._copy_to_device(max(num_tokens, padded), padded, num_cols, logits_indices, num_pending)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: n + 1],
            seq_lens=self.seq_lens[:n],
            block_tables=self.block_tables[:n, :num_cols],
            # Decodes lead the batch: the first row of more than one token ends them.
            num_decodes=n if decode_only else int(np.argmax(query_lens != 1)),
            max_query_len=int(query_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        return self._packed(
            states, num_scheduled, num_tokens, metadata, query_start_loc_np, sampling_rows,
            logits_indices, padded, num_pending,
        )  # fmt: skip

    def _prepare_flat(
        self,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        seq_of_token: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,  # per request
        num_cols: int,
        num_padded_rows: int | None,
        num_pending: int,
        query_start_loc_np: np.ndarray,
    ) -> PackedBatch:
        """A step of decodes and verifications (each a few tokens after a cached context) as a
        decode batch of one row per token: token i of a request attends to its context plus its
        first i + 1 tokens, through the same block-table row. The decode kernel and the decode
        CUDA graphs then serve verification steps too (vLLM and FlashInfer do the same)."""
        n = len(states)
        num_tokens = positions.shape[0]
        assert num_tokens <= self.max_num_seqs, "flattened rows must fit the decode buffers"
        # Sampling rows and logits indices are per request: taken before qsl becomes per token.
        sampling_rows, logits_indices = self._sampling_rows(states, seq_lens, False)
        padded = num_tokens if num_padded_rows is None else num_padded_rows
        bs, ids, qsl = self.block_size, self._ids, self._qsl
        rows = np.fromiter((s.row for s in states), np.int64, n)
        table = self._bt[: padded * num_cols].reshape(padded, num_cols)
        table[:num_tokens] = self.req_block_table[rows[seq_of_token], :num_cols]
        self._pos[:num_tokens] = positions
        tokens = np.arange(num_tokens)
        self._slots[:num_tokens] = table[tokens, positions // bs] * bs + positions % bs
        self._seq_lens[:num_tokens] = positions + 1
        qsl[: num_tokens + 1] = np.arange(num_tokens + 1)
        if padded > num_tokens:  # as in _fill_positions_and_slots: rows that touch nothing
            ids[num_tokens:padded] = 0
            self._pos[num_tokens:padded] = 0
            self._slots[num_tokens:padded] = -1
            self._seq_lens[num_tokens:padded] = 1
            qsl[num_tokens + 1 : padded + 1] = np.arange(num_tokens + 1, padded + 1)
            table[num_tokens:] = 0
        self._copy_to_device(padded, padded, num_cols, logits_indices, num_pending)
        metadata = AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            query_start_loc=self.query_start_loc[: num_tokens + 1],
            seq_lens=self.seq_lens[:num_tokens],
            block_tables=self.block_tables[:num_tokens, :num_cols],
            num_decodes=num_tokens,
            max_query_len=1,
            max_seq_len=int(seq_lens.max()),
        )
        return self._packed(
            states, num_scheduled, num_tokens, metadata, query_start_loc_np, sampling_rows,
            logits_indices, padded, num_pending,
        )  # fmt: skip

    def _packed(
        self,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        num_tokens: int,
        metadata: AttentionMetadata,
        query_start_loc_np: np.ndarray,
        sampling_rows: list[int],
        logits_indices: torch.Tensor | None,
        padded: int,
        num_pending: int,
    ) -> PackedBatch:
        """The step's PackedBatch over the first num_tokens of the persistent buffers."""
        return PackedBatch(
            req_ids=[s.req_id for s in states],
            num_scheduled=num_scheduled,
            input_ids=self.input_ids[:num_tokens],
            positions=self.positions[:num_tokens],
            metadata=metadata,
            query_start_loc_np=query_start_loc_np,
            sampling_rows=sampling_rows,
            logits_indices=logits_indices,
            num_padded_seqs=padded,
            num_pending_inputs=num_pending,
        )

    def _fill_input_ids(
        self,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        start: np.ndarray,  # [n] each sequence's first position this step
        decode_only: bool,
    ) -> tuple[np.ndarray, np.ndarray, int]:  # (sequence of each token, positions, num pending)
        """The step's input ids from the host copies of the tokens; a token the running step
        sampled (still on the device) is listed in pending_src/dst for the runner to copy."""
        n, ids, qsl = len(states), self._ids, self._qsl
        pending: list[tuple[int, int]] = []  # (input position, row of the last sampled ids)
        if decode_only:
            seq_of_token = np.arange(n)
            positions = start
            for r, s in enumerate(states):
                if s.num_computed_tokens < len(s.token_ids):
                    ids[r] = s.token_ids[s.num_computed_tokens]
                else:  # the token this decode computes was sampled by the step still running
                    pending.append((r, s.pending_index))
        else:
            # Token i of sequence r sits at position start[r] + i.
            num_tokens = int(qsl[n])
            seq_of_token = np.repeat(np.arange(n), np.asarray(num_scheduled, dtype=np.int64))
            positions = np.arange(num_tokens) - qsl[seq_of_token] + start[seq_of_token]
            for r, s in enumerate(states):
                a = s.num_computed_tokens
                if a >= len(s.token_ids):  # a decode of the token still on the device
                    pending.append((int(qsl[r]), s.pending_index))
                elif s.spec_token_ids:  # the last known token, then the drafts to verify
                    k = num_scheduled[r] - len(s.spec_token_ids)
                    ids[qsl[r] : qsl[r + 1]] = s.token_ids[a : a + k] + s.spec_token_ids
                else:
                    ids[qsl[r] : qsl[r + 1]] = s.token_ids[a : a + num_scheduled[r]]
        for i, (dst, src) in enumerate(pending):
            self._pending_dst[i] = dst
            self._pending_src[i] = src
        return seq_of_token, positions, len(pending)

    def _fill_positions_and_slots(
        self,
        states: list[CachedRequestState],
        seq_of_token: np.ndarray,
        positions: np.ndarray,
        seq_lens: np.ndarray,
        num_cols: int,
        num_tokens: int,
        padded: int,
    ) -> None:
        """Positions, the compact block table, slot mapping and sequence lengths; rows past the
        real sequences (a decode batch padded to a graph size) are harmless padding."""
        n, bs, ids, qsl = len(states), self.block_size, self._ids, self._qsl
        rows = np.fromiter((s.row for s in states), np.int64, n)
        table = self._bt[: padded * num_cols].reshape(padded, num_cols)
        table[:n] = self.req_block_table[rows, :num_cols]
        self._pos[:num_tokens] = positions
        self._slots[:num_tokens] = table[seq_of_token, positions // bs] * bs + positions % bs
        self._seq_lens[:n] = seq_lens
        if padded > n:
            # Padding rows: token 0 at position 0 attending to one key of block 0 (harmless reads);
            # slot -1 tells the KV write to skip them, so no real sequence's cache is touched.
            ids[n:padded] = 0
            self._pos[n:padded] = 0
            self._slots[n:padded] = -1
            self._seq_lens[n:padded] = 1
            qsl[n + 1 : padded + 1] = np.arange(n + 1, padded + 1)
            table[n:] = 0

    def _sampling_rows(
        self, states: list[CachedRequestState], seq_lens: np.ndarray, decode_only: bool
    ) -> tuple[list[int], torch.Tensor | None]:
        """Who samples: requests whose scheduled tokens reach their last known token (plus the
        drafts they verify); and where their logits are (None: row i samples at token i). A
        request verifying K drafts has K + 1 logits rows, its last K + 1 tokens."""
        n, qsl = len(states), self._qsl
        num_known = np.fromiter((s.num_tokens for s in states), np.int64, n)
        num_spec = np.fromiter((len(s.spec_token_ids) for s in states), np.int64, n)
        samples = seq_lens - num_spec == num_known
        if decode_only and samples.all():
            return list(range(n)), None
        sampling_rows = np.flatnonzero(samples).tolist()
        ends = qsl[1 : n + 1][samples]
        if not num_spec.any():
            k = len(sampling_rows)
            self._logits_idx[:k] = ends - 1
        else:
            rows = num_spec[samples] + 1
            k = int(rows.sum())
            first = np.repeat(ends - rows, rows)  # each row's first logits position ...
            self._logits_idx[:k] = first + np.arange(k) - np.repeat(np.cumsum(rows) - rows, rows)
        return sampling_rows, self.logits_indices[:k]

    def _copy_to_device(
        self,
        num_tokens: int,
        num_seqs: int,
        num_cols: int,
        logits_indices: torch.Tensor | None,
        num_pending: int,
    ) -> None:
        """One asynchronous copy per buffer, of the prefix this step uses."""
        nb = True
        self.input_ids[:num_tokens].copy_(self.input_ids_cpu[:num_tokens], non_blocking=nb)
        self.positions[:num_tokens].copy_(self.positions_cpu[:num_tokens], non_blocking=nb)
        self.slot_mapping[:num_tokens].copy_(self.slot_mapping_cpu[:num_tokens], non_blocking=nb)
        self.seq_lens[:num_seqs].copy_(self.seq_lens_cpu[:num_seqs], non_blocking=nb)
        self.query_start_loc[: num_seqs + 1].copy_(
            self.query_start_loc_cpu[: num_seqs + 1], non_blocking=nb
        )
        # The table travels compact ([num_seqs, num_cols]) and is spread into its row-stride-w
        # home on the device: a step moves only the columns its longest sequence needs.
        size = num_seqs * num_cols
        self.block_table_staging[:size].copy_(self.block_table_cpu[:size], non_blocking=nb)
        self.block_tables[:num_seqs, :num_cols].copy_(
            self.block_table_staging[:size].view(num_seqs, num_cols)
        )
        if logits_indices is not None:
            k = logits_indices.shape[0]
            logits_indices.copy_(self.logits_indices_cpu[:k], non_blocking=nb)
        if num_pending:
            self.pending_dst[:num_pending].copy_(
                self.pending_dst_cpu[:num_pending], non_blocking=nb
            )
            self.pending_src[:num_pending].copy_(
                self.pending_src_cpu[:num_pending], non_blocking=nb
            )
        if self._copies_done is not None:
            self._copies_done.record()
            self._copies_pending = True
