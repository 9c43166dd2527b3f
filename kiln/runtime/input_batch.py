"""Packs one step's scheduled tokens into flat tensors (no padding) for the model.

The buffers persist across steps: host arrays (pinned on CUDA, so copies are asynchronous) are
filled with numpy, copied once into device tensors of fixed address, and the model reads views of
those. Fixed addresses are what CUDA graphs need; pinned memory is what lets the host run ahead of
the GPU. Each request keeps a row of a persistent host block table, so a step gathers block ids
with one numpy index instead of converting Python lists.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from itertools import accumulate

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
    block_ids: list[int]  # (a hybrid model's: its first KV cache group's; InputBuffers has all)
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
    lora_int_id: int | None = None
    """Its LoRA adapter (the runner's LoRAModel knows the slot holding it); None: the base."""

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
    # Where the sampling rows' logits are: [num_logits_rows] token indices (a request verifying K
    # drafts has K + 1); None: at tokens 0..num_logits_rows-1 (then a view, no gather, no copy).
    logits_indices: torch.Tensor | None
    num_padded_seqs: int  # num_seqs rounded up to a CUDA-graph batch size (= num_seqs if eager)
    # Input tokens still on the device (sampled by the previous step, async scheduling): the
    # runner copies them into input_ids from that step's ids (InputBuffers.pending_src/dst).
    num_pending_inputs: int = 0
    num_logits_rows: int = 0


class InputBuffers:
    """Persistent host and device buffers for one step's inputs (see the module docstring)."""

    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
        num_groups: int = 1,
    ) -> None:
        """`num_groups`: KV cache groups (kiln.models.kv_groups), each with its own block-table
        rows and slot mapping; the first group's are the plain buffers below."""
        self.device = device
        self.num_groups = g = num_groups
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_tokens = max(max_num_tokens, max_num_seqs)  # a padded decode batch fits
        # The kernels' table rows are padded to a multiple of 16 entries (64 bytes): Triton
        # specializes a kernel on whether each int argument divides by 16 and each pointer is
        # 16-byte aligned, so a row stride that always divides by 16 gives every step (eager or
        # graph, any table width, any row the prefill rows start at) one compiled variant. A
        # table cut at a step's own width compiled a second prefill kernel mid-run (1.8 s).
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.table_row_stride = -(-self.max_blocks_per_seq // 16) * 16
        pin = device.type == "cuda"
        t, s, w = self.max_num_tokens, max_num_seqs, self.table_row_stride

        def host(n: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(n, dtype=dtype, pin_memory=pin)

        def dev(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        # Buffers of one dtype that every step copies share one host and one device allocation,
        # laid out so that a step's used parts fall in one prefix: one copy moves them all (each
        # copy is a launch, ~5-10 us of host time, and a fixed latency on the device), at the
        # price of also moving the unused tails of the buffers before the last (2 * t int64 and
        # 2 * s + 1 int32: ~32 KiB at t = 2048, well under a copy's own latency).
        # int64, per token: input ids | positions | slot mapping (each group's in turn).
        self._tok_cpu, self._tok = host((2 + g) * t, torch.int64), dev((2 + g) * t, torch.int64)
        self.input_ids_cpu, self.positions_cpu, self.slot_mapping_cpu = self._tok_cpu.split(t)[:3]
        self.input_ids, self.positions, self.slot_mapping = self._tok.split(t)[:3]
        self.group_slot_mappings = self._tok.split(t)[2:]  # [num_groups] of [t]
        # int32, per sequence: query start locations | sequence lengths | the compact table(s).
        n32 = (s + 1) + s + g * s * w
        self._seq_cpu, self._seq = host(n32, torch.int32), dev(n32, torch.int32)
        self.query_start_loc_cpu, self.seq_lens_cpu, self.block_table_cpu = self._seq_cpu.split(
            [s + 1, s, g * s * w]
        )
        self.query_start_loc, self.seq_lens, self.block_table_staging = self._seq.split(
            [s + 1, s, g * s * w]
        )
        self.logits_indices_cpu = host(t, torch.int64)  # t: a row per verified draft too
        # The step's one device->host copy lands here; two, since with async scheduling a step's
        # ids are copied while the previous step's are still being read.
        self.sampled_cpu = (host(s, torch.int64), host(s, torch.int64))
        # Pending input tokens (async scheduling): input_ids positions to fill on the device |
        # ... from these rows of the last sampled ids. One copy, as above.
        self._pending_cpu, self._pending = host(2 * s, torch.int64), dev(2 * s, torch.int64)
        self.pending_dst_cpu, self.pending_src_cpu = self._pending_cpu.split(s)
        self.pending_dst, self.pending_src = self._pending.split(s)

        # The kernels' tables, row stride w: each group's.
        self.group_block_tables = dev((g, s, w), torch.int32)
        self.block_tables = self.group_block_tables[0]
        self.logits_indices = dev(t, torch.int64)

        # numpy views of the host buffers (same memory).
        self._ids = self.input_ids_cpu.numpy()
        self._pos = self.positions_cpu.numpy()
        self._slots = self.slot_mapping_cpu.numpy()
        self._group_slots = self._tok_cpu[2 * t :].numpy().reshape(g, t)
        self._seq_lens = self.seq_lens_cpu.numpy()
        self._qsl = self.query_start_loc_cpu.numpy()
        self._bt = self.block_table_cpu.numpy()
        self._logits_idx = self.logits_indices_cpu.numpy()
        self._pending_dst = self.pending_dst_cpu.numpy()
        self._pending_src = self.pending_src_cpu.numpy()

        # Each live request's block ids, one persistent row each (in each group).
        self.req_block_tables = np.zeros((g, s, w), dtype=np.int32)
        self.req_block_table = self.req_block_tables[0]
        self._free_rows = list(range(s - 1, -1, -1))
        self._copies_done = torch.cuda.Event() if pin else None
        self._copies_pending = False
        # A step's views of the persistent buffers, by size: slicing a tensor costs ~1-3 us of
        # host time, a step takes a dozen such views, and decode steps repeat a few sizes.
        self._view_cache: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self._iota = np.arange(max(t, s) + 1, dtype=np.int32)  # query start locations of rows

    def _views(self, kind: str, *size: int) -> tuple[torch.Tensor, ...]:
        """The step's views of one group of buffers (see _make_views), made once per size."""
        key = (kind, *size)
        views = self._view_cache.get(key)
        if views is None:
            if len(self._view_cache) >= 4096:  # bounded: sizes seen once are not kept forever
                self._view_cache.clear()
            views = self._view_cache[key] = self._make_views(kind, *size)
        return views

    def _make_views(self, kind: str, *size: int) -> tuple[torch.Tensor, ...]:
        if kind == "tokens":  # (input ids, positions, slot mapping) of num_tokens
            (k,) = size
            return self.input_ids[:k], self.positions[:k], self.slot_mapping[:k]
        if kind == "seqs":  # (query start locations, sequence lengths) of num_seqs
            (k,) = size
            return self.query_start_loc[: k + 1], self.seq_lens[:k]
        if kind == "table":  # the kernels' table, and its compact staging, [num_seqs, num_cols]
            k, c = size
            return self.block_tables[:k, :c], self.block_table_staging[: k * c].view(k, c)
        if kind == "tables":  # every group's: [num_groups, num_seqs, num_cols]
            k, c = size
            g = self.num_groups
            staging = self.block_table_staging[: g * k * c].view(g, k, c)
            return self.group_block_tables[:, :k, :c], staging
        if kind == "group":  # group g's slot mapping (num_tokens), table [num_seqs, num_cols]
            g, t, k, c = size
            return self.group_slot_mappings[g][:t], self.group_block_tables[g, :k, :c]
        if kind == "copy":  # (device, host) prefixes of one copy's shared allocation
            which, end = size
            if which == 0:  # per token: ... through the last group's slot mapping
                end += (self.num_groups - 1) * self.max_num_tokens
            elif which == 1:  # per sequence: ... through the last group's compact table
                end += (self.num_groups - 1) * (end - 2 * self.max_num_seqs - 1)
            dev, host = [
                (self._tok, self._tok_cpu),
                (self._seq, self._seq_cpu),
                (self._pending, self._pending_cpu),
                (self.logits_indices, self.logits_indices_cpu),
            ][which]
            return dev[:end], host[:end]
        raise ValueError(kind)

    # ---- per-request rows --------------------------------------------------------------------

    def add_request(self, block_ids: list[int]) -> int:
        """A row for a request's blocks (several groups: each group's in turn, equal lengths)."""
        if not self._free_rows:
            raise RuntimeError(f"more than max_num_seqs={self.max_num_seqs} requests in the runner")
        row = self._free_rows.pop()
        if self.num_groups > 1:
            self.append_blocks(row, 0, block_ids)
            return row
        self.req_block_table[row, : len(block_ids)] = block_ids
        return row

    def append_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        """Blocks from entry `start` of the row on (several groups: each group's in turn)."""
        if not block_ids:
            return
        if self.num_groups > 1:
            per_group = len(block_ids) // self.num_groups
            ids = np.asarray(block_ids, dtype=np.int32).reshape(self.num_groups, per_group)
            self.req_block_tables[:, row, start : start + per_group] = ids
            return
        self.req_block_table[row, start : start + len(block_ids)] = block_ids

    def remove_request(self, row: int) -> None:
        self._free_rows.append(row)

    # ---- one step ----------------------------------------------------------------------------

    def wait_for_copies(self) -> None:
        """The host buffers are about to be rewritten: the last step's copies must have read them.
        (Normally done: they were queued before the last step's forward, and the host has since
        waited for the step before that.)"""
        if self._copies_pending:
            assert self._copies_done is not None  # copies are pending only where it records them
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
        # Sizes in plain Python: numpy's reductions cost microseconds each on arrays this small.
        n = len(states)
        num_tokens = sum(num_scheduled)
        decode_only = num_tokens == n
        qsl = self._qsl
        if decode_only:
            qsl[: n + 1] = self._iota[: n + 1]
            qsl_list = None
        else:
            qsl_list = [0, *accumulate(num_scheduled)]
            qsl[: n + 1] = qsl_list
        starts = [s.num_computed_tokens for s in states]
        seq_lens_list = [a + q for a, q in zip(starts, num_scheduled)]
        max_seq_len = max(seq_lens_list)
        start = np.array(starts, dtype=np.int64)
        seq_lens = np.array(seq_lens_list, dtype=np.int64)
        seq_of_token, positions, num_pending = self._fill_input_ids(
            states, num_scheduled, start, qsl_list
        )

        num_cols = -(-max_seq_len // self.block_size)
        query_start_loc_np = qsl[: n + 1].copy()
        if flatten:
            return self._prepare_flat(
                states, num_scheduled, seq_of_token, positions, seq_lens_list, num_cols,
                num_padded_seqs, num_pending, query_start_loc_np, max_seq_len,
            )  # fmt: skip
        padded = n if num_padded_seqs is None else num_padded_seqs
        assert padded == n or decode_only, "only decode-only steps are padded"
        self._fill_positions_and_slots(
            states, seq_of_token, positions, seq_lens, num_cols, num_tokens, padded
        )
        sampling_rows, logits_rows = self._sampling_rows(states, seq_lens_list)
        logits_indices = self._logits_indices(logits_rows)
        self._copy_to_device(max(num_tokens, padded), padded, num_cols, logits_indices, num_pending)
        slot_mapping = self._views("tokens", num_tokens)[2]
        query_start_loc, seq_lens_dev = self._views("seqs", n)
        # Decodes lead the batch: the first row of more than one token ends them.
        num_decodes = n if decode_only else next(i for i, q in enumerate(num_scheduled) if q != 1)
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_dev,
            block_tables=self._views("table", n, num_cols)[0],
            num_decodes=num_decodes,
            max_query_len=max(num_scheduled),
            max_seq_len=max_seq_len,
        )
        if self.num_groups > 1:
            metadata = self.with_groups(metadata, num_tokens, n, num_cols)
        return self._packed(
            states, num_scheduled, num_tokens, metadata, query_start_loc_np, sampling_rows,
            logits_indices, len(logits_rows), padded, num_pending,
        )  # fmt: skip

    def _prepare_flat(
        self,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        seq_of_token: np.ndarray,
        positions: np.ndarray,
        seq_lens: list[int],  # per request
        num_cols: int,
        num_padded_rows: int | None,
        num_pending: int,
        query_start_loc_np: np.ndarray,
        max_seq_len: int,
    ) -> PackedBatch:
        """A step of decodes and verifications (each a few tokens after a cached context) as a
        decode batch of one row per token: token i of a request attends to its context plus its
        first i + 1 tokens, through the same block-table row. The decode kernel and the decode
        CUDA graphs then serve verification steps too (vLLM and FlashInfer do the same)."""
        n = len(states)
        num_tokens = positions.shape[0]
        assert num_tokens <= self.max_num_seqs, "flattened rows must fit the decode buffers"
        # Sampling rows and logits indices are per request: taken before qsl becomes per token.
        sampling_rows, logits_rows = self._sampling_rows(states, seq_lens)
        logits_indices = self._logits_indices(logits_rows)
        padded = num_tokens if num_padded_rows is None else num_padded_rows
        bs, ids, qsl = self.block_size, self._ids, self._qsl
        rows = np.fromiter((s.row for s in states), np.int64, n)
        table = self._bt[: padded * num_cols].reshape(padded, num_cols)
        table[:num_tokens] = self.req_block_table[rows[seq_of_token], :num_cols]
        self._pos[:num_tokens] = positions
        block, offset = np.divmod(positions, bs)
        self._slots[:num_tokens] = table[self._iota[:num_tokens], block] * bs + offset
        self._seq_lens[:num_tokens] = positions + 1
        qsl[: padded + 1] = self._iota[: padded + 1]  # one row per token, padding rows too
        if padded > num_tokens:  # as in _fill_positions_and_slots: rows that touch nothing
            ids[num_tokens:padded] = 0
            self._pos[num_tokens:padded] = 0
            self._slots[num_tokens:padded] = -1
            self._seq_lens[num_tokens:padded] = 1
            table[num_tokens:] = 0
        if self.num_groups > 1:
            table_rows = rows[seq_of_token]
            self._fill_groups(table_rows, self._iota[:num_tokens], block, offset, padded, num_cols)
        self._copy_to_device(padded, padded, num_cols, logits_indices, num_pending)
        query_start_loc, seq_lens_dev = self._views("seqs", num_tokens)
        metadata = AttentionMetadata(
            slot_mapping=self._views("tokens", num_tokens)[2],
            query_start_loc=query_start_loc,
            seq_lens=seq_lens_dev,
            block_tables=self._views("table", num_tokens, num_cols)[0],
            num_decodes=num_tokens,
            max_query_len=1,
            max_seq_len=max_seq_len,
        )
        if self.num_groups > 1:
            metadata = self.with_groups(metadata, num_tokens, num_tokens, num_cols)
        return self._packed(
            states, num_scheduled, num_tokens, metadata, query_start_loc_np, sampling_rows,
            logits_indices, len(logits_rows), padded, num_pending,
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
        num_logits_rows: int,
        padded: int,
        num_pending: int,
    ) -> PackedBatch:
        """The step's PackedBatch over the first num_tokens of the persistent buffers."""
        input_ids, positions, _ = self._views("tokens", num_tokens)
        return PackedBatch(
            req_ids=[s.req_id for s in states],
            num_scheduled=num_scheduled,
            input_ids=input_ids,
            positions=positions,
            metadata=metadata,
            query_start_loc_np=query_start_loc_np,
            sampling_rows=sampling_rows,
            logits_indices=logits_indices,
            num_padded_seqs=padded,
            num_pending_inputs=num_pending,
            num_logits_rows=num_logits_rows,
        )

    def _fill_input_ids(
        self,
        states: list[CachedRequestState],
        num_scheduled: list[int],
        start: np.ndarray,  # [n] each sequence's first position this step
        qsl: list[int] | None,  # query start locations; None: a decode-only step
    ) -> tuple[np.ndarray, np.ndarray, int]:  # (sequence of each token, positions, num pending)
        """The step's input ids from the host copies of the tokens; a token the running step
        sampled (still on the device) is listed in pending_src/dst for the runner to copy."""
        n, ids = len(states), self._ids
        pending: list[tuple[int, int]] = []  # (input position, row of the last sampled ids)
        if qsl is None:
            seq_of_token = np.arange(n)
            positions = start
            for r, s in enumerate(states):
                if s.num_computed_tokens < len(s.token_ids):
                    ids[r] = s.token_ids[s.num_computed_tokens]
                else:  # the token this decode computes was sampled by the step still running
                    pending.append((r, s.pending_index))
        else:
            # Token i of sequence r sits at position start[r] + i.
            num_tokens = qsl[n]
            seq_of_token = np.repeat(np.arange(n), num_scheduled)
            # start[r] - qsl[r] per sequence, spread over its tokens.
            offset = start - np.array(qsl[:n], dtype=np.int64)
            positions = np.arange(num_tokens) + offset[seq_of_token]
            for r, s in enumerate(states):
                a = s.num_computed_tokens
                if a >= len(s.token_ids):  # a decode of the token still on the device
                    pending.append((qsl[r], s.pending_index))
                elif s.spec_token_ids:  # the last known token, then the drafts to verify
                    k = num_scheduled[r] - len(s.spec_token_ids)
                    ids[qsl[r] : qsl[r + 1]] = s.token_ids[a : a + k] + s.spec_token_ids
                else:
                    ids[qsl[r] : qsl[r + 1]] = s.token_ids[a : a + num_scheduled[r]]
        if pending:  # (async decodes: every row) one numpy write a buffer, not two a row
            dst, src = zip(*pending)
            self._pending_dst[: len(pending)] = dst
            self._pending_src[: len(pending)] = src
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
        block, offset = np.divmod(positions, bs)
        self._slots[:num_tokens] = table[seq_of_token, block] * bs + offset
        self._seq_lens[:n] = seq_lens
        if padded > n:
            # Padding rows: token 0 at position 0 attending to one key of block 0 (harmless reads);
            # slot -1 tells the KV write to skip them, so no real sequence's cache is touched.
            ids[n:padded] = 0
            self._pos[n:padded] = 0
            self._slots[n:padded] = -1
            self._seq_lens[n:padded] = 1
            qsl[n + 1 : padded + 1] = self._iota[n + 1 : padded + 1]
            table[n:] = 0
        if self.num_groups > 1:
            self._fill_groups(rows, seq_of_token, block, offset, padded, num_cols)

    def _fill_groups(
        self,
        table_rows: np.ndarray,  # [num_rows] each attention row's request row
        token_rows: np.ndarray,  # [num_tokens] each token's attention row
        block: np.ndarray,  # [num_tokens] each token's block index
        offset: np.ndarray,  # [num_tokens] ... and offset in it
        padded: int,  # attention rows, padding included (as many tokens past the real ones)
        num_cols: int,
    ) -> None:
        """The other KV cache groups' compact tables and slot mappings (group 0's are filled
        as a one-group model's): the same tokens through each group's block ids."""
        g, n, num_tokens = self.num_groups, len(table_rows), len(token_rows)
        tables = self._bt[: g * padded * num_cols].reshape(g, padded, num_cols)[1:]
        tables[:, :n] = self.req_block_tables[1:, table_rows, :num_cols]
        tables[:, n:] = 0
        slots = self._group_slots[1:]
        slots[:, :num_tokens] = tables[:, token_rows, block] * self.block_size + offset
        slots[:, num_tokens : num_tokens + padded - n] = -1  # padding rows write nothing

    def with_groups(
        self, metadata: AttentionMetadata, num_tokens: int, num_seqs: int, num_cols: int
    ) -> AttentionMetadata:
        """`metadata` (group 0's) with the other groups' (slot mapping, table) views over the
        same rows (AttentionMetadata.group_metadata)."""
        views = self._views
        others = []
        for g in range(1, self.num_groups):
            slot_mapping, block_tables = views("group", g, num_tokens, num_seqs, num_cols)
            others.append(replace(metadata, slot_mapping=slot_mapping, block_tables=block_tables))
        return replace(metadata, group_metadata=tuple(others))

    def _sampling_rows(
        self, states: list[CachedRequestState], seq_lens: list[int]
    ) -> tuple[list[int], list[int]]:
        """Who samples: requests whose scheduled tokens reach their last known token (plus the
        drafts they verify); and the tokens their logits are at. A request verifying K drafts
        has K + 1 logits rows, its last K + 1 tokens. A Python loop: at the batch sizes where
        the host's time shows (a few requests), numpy's per-call costs are most of it."""
        sampling_rows: list[int] = []
        logits_idx: list[int] = []
        ends = self._qsl[1 : len(states) + 1].tolist()  # each request's last token + 1
        for r, (state, seq_len, end) in enumerate(zip(states, seq_lens, ends)):
            k = len(state.spec_token_ids)
            if seq_len - k == len(state.token_ids) + state.num_pending:  # (state.num_tokens)
                sampling_rows.append(r)
                if k:
                    logits_idx.extend(range(end - k - 1, end))
                else:  # a decode: its one token
                    logits_idx.append(end - 1)
        return sampling_rows, logits_idx

    def _logits_indices(self, logits_idx: list[int]) -> torch.Tensor | None:
        """The device tensor of the logits rows' tokens; None where they are the first ones
        (every decode samples; a verification step of decodes alone): the runner takes a view.
        The indices increase strictly, so the last being k - 1 means they are 0..k-1."""
        k = len(logits_idx)
        if not k or logits_idx[-1] == k - 1:
            return None
        self._logits_idx[:k] = logits_idx
        return self._views("copy", 3, k)[0]

    def _copy_to_device(
        self,
        num_tokens: int,
        num_seqs: int,
        num_cols: int,
        logits_indices: torch.Tensor | None,
        num_pending: int,
    ) -> None:
        """Three asynchronous copies at most (per-token int64, per-sequence int32, logits
        indices), plus the pending-input indices when there are any; see __init__'s layout."""
        nb = True
        views = self._views
        t, s = self.max_num_tokens, self.max_num_seqs
        dev, host = views("copy", 0, 2 * t + num_tokens)  # ... through the slot mapping's prefix
        dev.copy_(host, non_blocking=nb)
        # The table travels compact ([num_seqs, num_cols]) and is spread into its row-stride-w
        # home on the device: a step moves only the columns its longest sequence needs.
        dev, host = views("copy", 1, 2 * s + 1 + num_seqs * num_cols)
        dev.copy_(host, non_blocking=nb)
        table, staging = views("table" if self.num_groups == 1 else "tables", num_seqs, num_cols)
        table.copy_(staging)
        if logits_indices is not None:
            dev, host = views("copy", 3, logits_indices.shape[0])
            dev.copy_(host, non_blocking=nb)
        if num_pending:
            dev, host = views("copy", 2, s + num_pending)
            dev.copy_(host, non_blocking=nb)
        if self._copies_done is not None:
            self._copies_done.record()
            self._copies_pending = True
