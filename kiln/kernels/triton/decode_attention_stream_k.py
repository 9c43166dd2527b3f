"""Paged decode attention over a float8 cache with every program given the same work: a stream-K
schedule of the packed kernel (twin: reference.paged_decode_attention, through
decode_attention.paged_decode_attention_splits, which picks this kernel).

Why: at 1000/1000's shapes the packed kernel runs one program per (sequence, KV head), 8000 at
1000 sequences, 8 resident an SM: 7.58 waves of 1056 on an H200, and the last, partly filled
wave costs about half a wave whatever its fill (~3% of decode attention at 1000 x 1.5k, ~2% of a
decode step; docs/performance.md, "The H200 on 2026-12-03, fifth run"). More programs an SM,
padding the grid and uniform splits were each measured slower.

Here the grid is the programs the GPU holds at once (decode_attention.stream_k_programs), and
the work is a line of tiles (PACK * BLOCK_N keys each): every (sequence, KV head) row's tiles in
sequence-major order, at least one tile a row so an empty context still writes its zeros.
Program p takes tiles [p * T // P, (p + 1) * T // P) of the T in the line (P: the grid's
programs, at most T), so the programs' shares differ by at most one tile and all of them end
together. A program's share starts and ends inside rows: a row it holds whole is stored to the
output directly; a row it holds in part is a piece, stored with its log-sum-exp to the
program's slot (2p for a piece of its first row, 2p + 1 for its last), and the program then
takes a ticket from the counter of the row's first program. The program that takes the row's
last ticket merges the row's pieces in program order (so the output does not depend on which
finished first) and resets the counter, as split_k's GEMVs do: no reduce kernel, no memset, and
nothing waits on another program (the interpreter, which runs programs one after another,
computes the same).

Each program first finds where its share starts: the line's length and the sequence holding
its first tile, from a scan of seq_lens (a few KiB from L2 a program at 1000 sequences). The
partition a row gets depends on the whole batch, so a sequence's output can differ in its last
bits batched and alone (as a split count chosen by batch size already makes it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.triton.decode_attention_packed import _attend_packed, _attend_packed_natural


@triton.jit
def _row_tiles(seq_len, TILE: tl.constexpr):
    """Tiles of one (sequence, KV head) row: at least one, so an empty context is a row too."""
    return tl.maximum(tl.cdiv(seq_len, TILE), 1)


@triton.jit
def _program_of(tile, total, num_programs):
    """The program whose share [p * total // P, (p + 1) * total // P) holds `tile`: the largest p
    with p * total // P <= tile."""
    return ((tile + 1) * num_programs - 1) // total


@triton.jit
def _merge_pieces(
    part_out_ptr, part_lse_ptr, row_start, first, last, total, num_programs,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """A row's pieces, held by programs first..last, merged by their log-sum-exps in program
    order: [GROUP, HEAD_DIM] fp32. Read from L2 (.cg): other programs wrote them during this
    launch."""
    groups = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_DIM)
    m = tl.full([GROUP], float("-inf"), dtype=tl.float32)
    weight = tl.zeros([GROUP], dtype=tl.float32)
    acc = tl.zeros([GROUP, HEAD_DIM], dtype=tl.float32)
    for q in range(first, last + 1):
        # The piece is q's first row's when the row holds q's first tile, else q's last row's.
        slot = 2 * q + (row_start > q * total // num_programs).to(tl.int64)
        lse = tl.load(part_lse_ptr + slot * GROUP + groups, cache_modifier=".cg")
        part = tl.load(
            part_out_ptr + (slot * GROUP + groups)[:, None] * HEAD_DIM + dims[None, :],
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, lse)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_use)
        w = tl.exp2(lse - m_use)
        acc = acc * alpha[:, None] + w[:, None] * part
        weight = weight * alpha + w
        m = m_new
    return acc / tl.where(weight > 0.0, weight, 1.0)[:, None]


@triton.jit
def _decode_stream_k_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], token- or head-major
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim]
    part_out_ptr,  # [2 * programs, GROUP, head_dim] fp32: the pieces of rows held in part
    part_lse_ptr,  # [2 * programs, GROUP] fp32, log2 domain
    counters_ptr,  # [programs] int32, zero before and after the launch
    qk_scale,  # softmax scale * log2(e): the softmax runs on exp2
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    num_seqs,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head, a power of two
    PACK: tl.constexpr,  # sub-partitions side by side (decode_attention_packed)
    HEAD_DIM: tl.constexpr,  # a power of two
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per sub-tile; a tile of the line is PACK * BLOCK_N keys
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # float8 cache, bf16 query: dots in fp16 (see _device.fp16_dots)
    SCAN: tl.constexpr,  # seq_lens read a SCAN-long chunk at a time to find the share's start
    HEAD_MAJOR: tl.constexpr,  # the cache's blocks head-major (kiln/kernels/kv_layout.py)
    NATURAL: tl.constexpr = False,  # the key loop with two tiles in flight (_attend_packed_natural)
):
    TILE: tl.constexpr = PACK * BLOCK_N
    pid = tl.program_id(0).to(tl.int64)
    scan = tl.arange(0, SCAN)

    # The line's length: every sequence's rows.
    total = tl.zeros([], dtype=tl.int64)
    for chunk in range(0, num_seqs, SCAN):
        lens = tl.load(seq_lens_ptr + chunk + scan, mask=chunk + scan < num_seqs, other=0)
        tiles = tl.where(chunk + scan < num_seqs, _row_tiles(lens, TILE), 0).to(tl.int64)
        total += tl.sum(tiles, 0) * NUM_KV_HEADS
    # No more programs than tiles, so every share holds one at least and a row's pieces are the
    # programs from its first tile's to its last's; the grid's others have nothing to do.
    num_programs = tl.minimum(tl.num_programs(0).to(tl.int64), total)
    share_start = pid * total // num_programs
    share_end = tl.where(pid < num_programs, (pid + 1) * total // num_programs, share_start)

    # The sequence holding the share's first tile: the sequences whose rows all end at or
    # before it, and the tiles they hold.
    seq = tl.zeros([], dtype=tl.int32)
    seq_base = tl.zeros([], dtype=tl.int64)
    carry = tl.zeros([], dtype=tl.int64)
    for chunk in range(0, num_seqs, SCAN):
        lens = tl.load(seq_lens_ptr + chunk + scan, mask=chunk + scan < num_seqs, other=0)
        tiles = tl.where(chunk + scan < num_seqs, _row_tiles(lens, TILE), 0).to(tl.int64)
        ends = carry + tl.cumsum(tiles * NUM_KV_HEADS, 0)
        before = (ends <= share_start) & (chunk + scan < num_seqs)
        seq += tl.sum(before.to(tl.int32), 0)
        seq_base = tl.maximum(seq_base, tl.max(tl.where(before, ends, 0), 0))
        carry = tl.max(ends, 0)

    groups = tl.arange(0, GROUP)
    dims = tl.arange(0, HEAD_DIM)
    cursor = share_start
    while cursor < share_end:
        seq_len = tl.load(seq_lens_ptr + seq)
        row_tiles = _row_tiles(seq_len, TILE).to(tl.int64)
        kv_head = ((cursor - seq_base) // row_tiles).to(tl.int32)
        row_start = seq_base + kv_head * row_tiles
        row_end = row_start + row_tiles
        stop = tl.minimum(row_end, share_end)
        start = ((cursor - row_start) * TILE).to(tl.int32)
        end = tl.minimum((stop - row_start) * TILE, seq_len).to(tl.int32)
        if NATURAL:
            out, lse = _attend_packed_natural(
                q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end,
                qk_scale, stride_q_seq, stride_q_head, stride_bt_seq, NUM_KV_HEADS, GROUP, PACK,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, FP16_DOTS, HEAD_MAJOR,
            )  # fmt: skip
        else:
            out, lse = _attend_packed(
                q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end,
                qk_scale, stride_q_seq, stride_q_head, stride_bt_seq, NUM_KV_HEADS, GROUP, PACK,
                HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, FP16_DOTS, HEAD_MAJOR,
            )  # fmt: skip
        out_offsets = (
            seq.to(tl.int64) * stride_o_seq
            + (kv_head * GROUP + groups)[:, None] * stride_o_head
            + dims[None, :]
        )
        if (row_start >= share_start) & (row_end <= share_end):
            tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty))
        else:
            slot = 2 * pid + (row_start > share_start).to(tl.int64)
            part = slot * GROUP + groups
            tl.store(part_lse_ptr + part, lse)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], out)
            first = _program_of(row_start, total, num_programs)
            last = _program_of(row_end - 1, total, num_programs)
            # Every thread's stores before the ticket (taken with release semantics at GPU
            # scope; the last taker's acquire orders its reads after every piece's stores).
            tl.debug_barrier()
            ticket = tl.atomic_add(counters_ptr + first, 1, sem="acq_rel", scope="gpu")
            if ticket == last - first:
                tl.store(counters_ptr + first, 0)  # no other program touches it this launch
                merged = _merge_pieces(
                    part_out_ptr, part_lse_ptr, row_start, first, last, total, num_programs,
                    GROUP, HEAD_DIM,
                )  # fmt: skip
                tl.store(out_ptr + out_offsets, merged.to(out_ptr.dtype.element_ty))
        # Past the sequence's last head: the next sequence's rows start here.
        next_seq = stop == seq_base + NUM_KV_HEADS * row_tiles
        seq += next_seq.to(tl.int32)
        seq_base = tl.where(next_seq, stop, seq_base)
        cursor = stop
