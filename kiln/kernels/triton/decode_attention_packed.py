"""Paged decode attention with the padded rows put to work: PACK partitions of a program's keys
side by side in tl.dot's 16 rows (twin: reference.paged_decode_attention, through
decode_attention.paged_decode_attention_splits, which picks this kernel).

Why: decode_attention._decode_kernel puts a KV head's GROUP query heads (4 for Llama-3.1-8B) in the
M dimension of tl.dot, padded to 16, its minimum. Twelve of the sixteen rows are zeros that the
program carries through every step: the fp32 accumulator [16, head_dim], the scores and their
softmax (exp2 on 16 rows a key, 4 of them wanted). Over a float8 cache the one-warp program holds
255 registers, an SM keeps 8 of them, and per key a float8 tile costs 77% of a bf16 tile for half
its bytes (docs/performance.md, "The H200 on 2026-12-02, fifth run").

Here row r of the tile is query head r % GROUP of sub-partition r // GROUP: each iteration visits
PACK * BLOCK_N keys, sub-partition s taking keys [s * BLOCK_N, (s + 1) * BLOCK_N) of it. The query
tile holds the group's heads PACK times over (all 16 rows real); each sub-tile of keys is
multiplied by the whole query tile and only its own rows' scores are kept, so the tensor cores do
the same multiply-adds a key as before (they are far from busy), while the accumulator, the scores
and the softmax carry no zero rows: 4x less softmax work a key and 4x the keys per iteration for
the same registers. Each row is an independent online softmax over its sub-partition's keys; at
the end the PACK rows of a head are merged by their log-sum-exp, in registers, into the same
per-(sequence, head, split) output and LSE that decode_attention's reduce kernel merges across
splits. Rows whose sub-partition has no key yet keep m = -inf and l = 0 and weigh nothing.

When a cache block holds whole sub-tiles (block_size a multiple of BLOCK_N), a sub-tile's keys are
one block: its block id is one scalar load instead of a gather per key.

LOOP selects the key loop (same results; an A/B switch, decode_attention.PACKED_LOOP). LOOP 1, the
first version: PACK dots of [ROWS, BLOCK_N] a trip, each multiplying the whole query tile, a mask
on every key. Compiled for sm_90 (Triton 3.6, Llama-3.1-8B, one warp of 16-key sub-tiles) it
issues 20.2 instructions a key, 300 of its 1294 a trip register moves: q is re-read from shared
memory for each of the PACK dots (a dot operand is not kept in registers across the loop) and,
its 64-bit reads holding halves of two tensor-core fragments (K, widened after its 8-bit
shared-memory load, sets the operands' k-width to 4), re-assembled for each HMMA; 277 more are
integer work, mostly the per-key masks and addresses. LOOP 2 (benchmarks/
decode_packed_sass_count.py; benchmarks/results/2026-12-03-cpu-decode-packed-sass/): 13.5 a key,
12.4 on a trip that skips the rescale:
- one [ROWS, PACK * BLOCK_N] dot for the scores and one [ROWS, PACK * BLOCK_N] x [PACK * BLOCK_N,
  HEAD_DIM] dot for P @ V a trip (q read once, its fragments straight from ldmatrix: K is
  widened to fp16 right after its global load, as V is, so both operands have k-width 2);
- rows mapped so that the two rows an mma thread holds (g and g + 8) belong to one
  sub-partition: the P operand's zeros are whole fragments chosen per lane, not constants the
  compiler copies into every HMMA's operand registers;
- each row's own scores picked by multiplying by a 0 / qk_scale table (exact: x * 0 adds 0);
- the accumulator's rescale skipped when no row's maximum grew (alpha is exactly 1 then);
- the trips that lie wholly before `end` run without masks, one masked trip after them;
- whole cache blocks of keys addressed by one block id each.
LOOP 3 is LOOP 2 with K widened after its shared-memory load (fewer shared-memory bytes a key,
~100 register moves back for q's fragments).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.triton._decode_partition import _partition
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16


@triton.jit
def _sub_tile(
    cache_ptr, block_table, n0, offs_n, end, head_offset, dims,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Keys [n0, n0 + BLOCK_N) of one KV head, [BLOCK_N, HEAD_DIM] raw from the cache (zeros past
    `end`)."""
    n = n0 + offs_n
    n_mask = n < end
    if BLOCK_SIZE % BLOCK_N == 0:
        # n0 is a multiple of BLOCK_N, so the sub-tile lies in one cache block.
        block_id = tl.load(block_table + n0 // BLOCK_SIZE, mask=n0 < end, other=0).to(tl.int64)
        slots = block_id * BLOCK_SIZE + (n0 % BLOCK_SIZE) + offs_n
    else:
        block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = block_ids * BLOCK_SIZE + n % BLOCK_SIZE
    offsets = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + head_offset + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=n_mask[:, None], other=0.0)


@triton.jit
def _tile(
    cache_ptr, block_table, n_start, end, head_offset, dims,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    """Keys [n_start, n_start + TILE) of one KV head, [TILE, HEAD_DIM] raw from the cache (zeros
    past `end` when MASKED; unmasked, every key lies before `end`); n_start is a multiple of
    TILE."""
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    if BLOCK_SIZE % TILE == 0:
        # The tile lies in one cache block: one scalar block id.
        if MASKED:
            block_id = tl.load(block_table + n_start // BLOCK_SIZE, mask=n_start < end, other=0)
        else:
            block_id = tl.load(block_table + n_start // BLOCK_SIZE)
        n = n_start + tl.arange(0, TILE)
        slots = block_id.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
        offsets = slots[:, None] * ROW + head_offset + dims[None, :]
        if MASKED:
            return tl.load(cache_ptr + offsets, mask=(n < end)[:, None], other=0.0)
        return tl.load(cache_ptr + offsets)
    if TILE % BLOCK_SIZE == 0:
        # Whole cache blocks (n_start is a multiple of TILE, so of BLOCK_SIZE): one block id a
        # block, a scalar base pointer each, the same offsets within every block.
        offs_b = tl.arange(0, TILE // BLOCK_SIZE)
        offs_s = tl.arange(0, BLOCK_SIZE)
        if MASKED:
            block_ids = tl.load(
                block_table + n_start // BLOCK_SIZE + offs_b,
                mask=n_start + offs_b * BLOCK_SIZE < end, other=0,
            )  # fmt: skip
        else:
            block_ids = tl.load(block_table + n_start // BLOCK_SIZE + offs_b)
        base = cache_ptr + block_ids.to(tl.int64) * (BLOCK_SIZE * ROW)
        within = offs_s[:, None] * ROW + head_offset + dims[None, :]
        ptrs = base[:, None, None] + within[None, :, :]
        if MASKED:
            n = n_start + offs_b[:, None, None] * BLOCK_SIZE + offs_s[None, :, None]
            raw = tl.load(ptrs, mask=n < end, other=0.0)
        else:
            raw = tl.load(ptrs)
        return tl.reshape(raw, [TILE, HEAD_DIM])
    n = n_start + tl.arange(0, TILE)
    if MASKED:
        block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n < end, other=0)
    else:
        block_ids = tl.load(block_table + n // BLOCK_SIZE)
    slots = block_ids.to(tl.int64) * BLOCK_SIZE + n % BLOCK_SIZE
    offsets = slots[:, None] * ROW + head_offset + dims[None, :]
    if MASKED:
        return tl.load(cache_ptr + offsets, mask=(n < end)[:, None], other=0.0)
    return tl.load(cache_ptr + offsets)


@triton.jit
def _packed_step(
    q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table, n_start, end, head_offset, dims,
    sub_of_row, qk_scale,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr, K_EARLY: tl.constexpr,
    MASKED: tl.constexpr,
):  # fmt: skip
    """LOOP 2's trip over keys [n_start, n_start + PACK * BLOCK_N): (acc, m_i, l_i) updated.
    MASKED for the one trip that may reach past `end`. K_EARLY: K widened by fp8e4m3_to_fp16
    right after its global load (else by Triton after its shared-memory load)."""
    ROWS: tl.constexpr = PACK * GROUP
    TILE: tl.constexpr = PACK * BLOCK_N
    k = _tile(
        k_cache_ptr, block_table, n_start, end, head_offset, dims, NUM_KV_HEADS, HEAD_DIM,
        BLOCK_SIZE, TILE, MASKED,
    )  # fmt: skip
    if FP16_DOTS and K_EARLY:  # noqa: SIM108 (resolved at compile time)
        k = fp8e4m3_to_fp16(k)
    else:
        k = k.to(q.dtype)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [ROWS, TILE]
    # Row r keeps columns [sub * BLOCK_N, (sub + 1) * BLOCK_N) of its sub-partition `sub`: a sum
    # over sub-partitions weighted qk_scale for its own and 0 for the others' (finite scores, so
    # each product with 0 adds exactly 0: the same value as selecting, scaled, in FMAs).
    own = sub_of_row[:, None, None] == tl.arange(0, PACK)[None, :, None]  # [ROWS, PACK, 1]
    s = tl.sum(tl.reshape(scores, [ROWS, PACK, BLOCK_N]) * tl.where(own, qk_scale, 0.0), 1)
    if MASKED:
        n = n_start + sub_of_row[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        s = tl.where(n < end, s, float("-inf"))
    # The online softmax, safe for rows with no key yet (m stays -inf: they weigh nothing).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_use[:, None])
    # Where no row's maximum grew, alpha is exp2(0) = 1 (or 0 on rows still empty, whose l and
    # acc are 0): the rescale changes nothing, and one uniform branch skips it.
    if tl.max((m_new > m_i).to(tl.int32), 0) != 0:
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha
        acc = acc * alpha[:, None]
    l_i = l_i + tl.sum(p, 1)
    v = _tile(
        v_cache_ptr, block_table, n_start, end, head_offset, dims, NUM_KV_HEADS, HEAD_DIM,
        BLOCK_SIZE, TILE, MASKED,
    )  # fmt: skip
    if FP16_DOTS:  # noqa: SIM108 (resolved at compile time)
        v = fp8e4m3_to_fp16(v)  # not v.to(tl.float16): see _fp8.py
    else:
        v = v.to(q.dtype)
    # P over the whole tile: row r's probabilities in its own sub-partition's columns, zeros in
    # the others' (the same multiply-adds as one dot a sub-partition, in one dot).
    p_full = tl.reshape(tl.where(own, p[:, None, :], 0.0), [ROWS, TILE]).to(v.dtype)
    acc = tl.dot(p_full, v, acc, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _decode_packed_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], contiguous
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim] (written when not SPLIT)
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32 (written when SPLIT)
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain (written when SPLIT)
    qk_scale,  # softmax scale * log2(e): the softmax runs on exp2
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head, a power of two
    PACK: tl.constexpr,  # sub-partitions side by side; PACK * GROUP rows (>= 16, tl.dot's M)
    HEAD_DIM: tl.constexpr,  # a power of two
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per sub-tile; an iteration visits PACK * BLOCK_N
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # float8 cache, bf16 query: dots in fp16 (see _device.fp16_dots)
    HEADS_FIRST: tl.constexpr,
    LOOP: tl.constexpr = 1,  # the key loop (see the module's docstring): 1, 2 or 3
):
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_size, num_valid = _partition(seq_len, num_splits, PACK * BLOCK_N)
    if SPLIT:  # noqa: SIM102 (resolved at compile time; the inner `if` is the device's)
        if split >= num_valid:
            return  # past this sequence's last partition: the reduce never reads this slot
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    ROWS: tl.constexpr = PACK * GROUP
    # Row r = (hi * PACK + sub) * SPAN + c holds head hi * SPAN + c of sub-partition `sub`.
    # LOOP 1: SPAN = GROUP (hi = 0: row r is head r % GROUP of sub-partition r // GROUP). LOOP 2
    # and 3: SPAN = 8 / PACK, so that rows g and g + 8, the two an mma thread holds, share a
    # sub-partition.
    SPAN: tl.constexpr = 8 // PACK if LOOP != 1 and ROWS == 16 and PACK <= 8 else GROUP
    rows = tl.arange(0, ROWS)
    sub_of_row = rows % (PACK * SPAN) // SPAN
    head_of_row = rows // (PACK * SPAN) * SPAN + rows % SPAN
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr
        + seq.to(tl.int64) * stride_q_seq
        + (kv_head * GROUP + head_of_row)[:, None] * stride_q_head
        + dims[None, :]
    )
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head * HEAD_DIM
    if LOOP == 1:
        for n_start in range(start, end, PACK * BLOCK_N):
            s = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
            for sub in tl.static_range(PACK):
                k = _sub_tile(
                    k_cache_ptr, block_table, n_start + sub * BLOCK_N, offs_n, end, head_offset,
                    dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                )  # fmt: skip
                scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
                s = tl.where((sub_of_row == sub)[:, None], scores, s)
            n = n_start + sub_of_row[:, None] * BLOCK_N + offs_n[None, :]
            s = tl.where(n < end, s * qk_scale, float("-inf"))  # [ROWS, BLOCK_N]
            # The online softmax, safe for rows with no key yet (m stays -inf: they weigh nothing).
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            acc = acc * alpha[:, None]
            for sub in tl.static_range(PACK):
                v_raw = _sub_tile(
                    v_cache_ptr, block_table, n_start + sub * BLOCK_N, offs_n, end, head_offset,
                    dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N,
                )  # fmt: skip
                if FP16_DOTS:  # noqa: SIM108 (resolved at compile time)
                    v = fp8e4m3_to_fp16(v_raw)  # not v.to(tl.float16): see _fp8.py
                else:
                    v = v_raw.to(q.dtype)
                p_sub = tl.where((sub_of_row == sub)[:, None], p, 0.0).to(v.dtype)
                acc = tl.dot(p_sub, v, acc, input_precision=DOT_PRECISION)
    else:
        # Trips wholly before `end` unmasked, then at most one masked trip (partitions are whole
        # trips, so only a sequence's last one has a partial trip).
        full_end = start + (end - start) // (PACK * BLOCK_N) * (PACK * BLOCK_N)
        for n_start in range(start, full_end, PACK * BLOCK_N):
            acc, m_i, l_i = _packed_step(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table, n_start, end,
                head_offset, dims, sub_of_row, qk_scale, NUM_KV_HEADS, GROUP, PACK, HEAD_DIM,
                BLOCK_SIZE, BLOCK_N, DOT_PRECISION, FP16_DOTS, LOOP == 2, False,
            )  # fmt: skip
        if full_end < end:
            acc, m_i, l_i = _packed_step(
                q, acc, m_i, l_i, k_cache_ptr, v_cache_ptr, block_table, full_end, end,
                head_offset, dims, sub_of_row, qk_scale, NUM_KV_HEADS, GROUP, PACK, HEAD_DIM,
                BLOCK_SIZE, BLOCK_N, DOT_PRECISION, FP16_DOTS, LOOP == 2, True,
            )  # fmt: skip

    # Merge each head's PACK rows: weights exp2(m_row - m_head), rows without keys weigh 0.
    HI: tl.constexpr = GROUP // SPAN
    m_rows = tl.reshape(m_i, [HI, PACK, SPAN])
    m_head = tl.max(m_rows, 1)
    m_head_use = tl.where(m_head == float("-inf"), 0.0, m_head)
    weights = tl.where(m_rows == float("-inf"), 0.0, tl.exp2(m_rows - m_head_use[:, None, :]))
    l_head = tl.reshape(tl.sum(tl.reshape(l_i, [HI, PACK, SPAN]) * weights, 1), [GROUP])
    acc_rows = tl.reshape(acc, [HI, PACK, SPAN, HEAD_DIM])
    acc_head = tl.reshape(tl.sum(acc_rows * weights[:, :, :, None], 1), [GROUP, HEAD_DIM])
    m_head = tl.reshape(m_head, [GROUP])
    # Only an empty context (seq_len 0, unsplit) leaves l == 0: it writes zeros.
    nonempty = l_head > 0.0
    out = acc_head / tl.where(nonempty, l_head, 1.0)[:, None]
    heads = kv_head * GROUP + tl.arange(0, GROUP)
    if SPLIT:
        lse = tl.where(nonempty, m_head + tl.log2(tl.where(nonempty, l_head, 1.0)), float("-inf"))
        part_index = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        tl.store(part_lse_ptr + part_index, lse)
        tl.store(part_out_ptr + part_index[:, None] * HEAD_DIM + dims[None, :], out)
    else:
        tl.store(
            out_ptr
            + seq.to(tl.int64) * stride_o_seq
            + heads[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
        )


def packing(group: int, head_dim: int) -> int:
    """Sub-partitions the packed kernel runs side by side for this group size (0: it does not
    apply: a group or head_dim that is not a power of two, or a group that fills 16 rows)."""
    if group & (group - 1) or head_dim & (head_dim - 1) or group >= 16:
        return 0
    return 16 // group
