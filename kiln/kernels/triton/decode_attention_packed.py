"""Paged decode attention with the padded rows put to work: PACK partitions of a program's keys
side by side in tl.dot's 16 rows (twin: reference.paged_decode_attention, through
decode_attention.paged_decode_attention_splits, which picks this kernel).

Why: decode_attention._decode_kernel puts a KV head's GROUP query heads (4 for Llama-3.1-8B) in the
M dimension of tl.dot, padded to 16, its minimum. Twelve of the sixteen rows are zeros that the
program carries through every step: the fp32 accumulator [16, head_dim], the scores and their
softmax (exp2 on 16 rows a key, 4 of them wanted). Over a float8 cache the one-warp program held
255 registers, an SM kept 8 of them, and per key a float8 tile cost 77% of a bf16 tile on an H200
for half its bytes.

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
"""

from __future__ import annotations

import triton
import triton.language as tl

from kiln.kernels.triton._decode_partition import _mark_unused_split, _partition, _window_start
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16
from kiln.kernels.triton._kv_layout import kv_head_offset, kv_tile_offsets
from kiln.kernels.triton._online_softmax import soft_cap


@triton.jit
def _sub_tile(
    cache_ptr, block_table, n0, offs_n, lo, end, head_offset, dims,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr,
):  # fmt: skip
    """Keys [n0, n0 + BLOCK_N) of one KV head (head_offset: _kv_layout.kv_head_offset), [BLOCK_N,
    HEAD_DIM] raw from the cache (zeros past `end`, and before `lo` when SLIDING: blocks a
    window left behind may be another request's)."""
    n = n0 + offs_n
    n_mask = n < end
    if SLIDING:
        n_mask = n_mask & (n >= lo)
    if BLOCK_SIZE % BLOCK_N == 0:
        # n0 is a multiple of BLOCK_N, so the sub-tile lies in one cache block.
        block_id = tl.load(block_table + n0 // BLOCK_SIZE, mask=n0 < end, other=0).to(tl.int64)
        offsets = kv_tile_offsets(
            block_id, (n0 % BLOCK_SIZE) + offs_n, head_offset, dims, NUM_KV_HEADS, HEAD_DIM,
            BLOCK_SIZE,
        )  # fmt: skip
    else:
        block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        offsets = kv_tile_offsets(
            block_ids, n % BLOCK_SIZE, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE,
        )  # fmt: skip
    return tl.load(cache_ptr + offsets, mask=n_mask[:, None], other=0.0)


@triton.jit
def _attend_packed(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end, qk_scale,
    stride_q_seq, stride_q_head, stride_bt_seq, lo, softcap_in, softcap_out,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr, SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """A KV head's GROUP query heads over keys [start, end) of sequence `seq`: (out [GROUP,
    HEAD_DIM] fp32, normalised; lse [GROUP], log2 domain). No key (start >= end) gives zeros and
    lse -inf, which a merge weighs as nothing."""
    ROWS: tl.constexpr = PACK * GROUP
    rows = tl.arange(0, ROWS)
    sub_of_row = rows // GROUP
    dims = tl.arange(0, HEAD_DIM)
    # The query tile holds the group's heads PACK times over: row r is head r % GROUP.
    q = tl.load(
        q_ptr
        + seq.to(tl.int64) * stride_q_seq
        + (kv_head * GROUP + rows % GROUP)[:, None] * stride_q_head
        + dims[None, :]
    )
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head_offset(kv_head, HEAD_DIM, BLOCK_SIZE)
    for n_start in range(start, end, PACK * BLOCK_N):
        s = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        for sub in tl.static_range(PACK):
            k = _sub_tile(
                k_cache_ptr, block_table, n_start + sub * BLOCK_N, offs_n, lo, end, head_offset,
                dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SLIDING,
            )  # fmt: skip
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            s = tl.where((sub_of_row == sub)[:, None], scores, s)
        n = n_start + sub_of_row[:, None] * BLOCK_N + offs_n[None, :]
        if SOFTCAP:  # noqa: SIM108 (resolved at compile time)
            s = soft_cap(s, softcap_in, softcap_out)
        else:
            s = s * qk_scale
        visible = n < end
        if SLIDING:
            visible = visible & (n >= lo)
        s = tl.where(visible, s, float("-inf"))  # [ROWS, BLOCK_N]
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
                v_cache_ptr, block_table, n_start + sub * BLOCK_N, offs_n, lo, end, head_offset,
                dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, SLIDING,
            )  # fmt: skip
            if FP16_DOTS:  # noqa: SIM108 (resolved at compile time)
                v = fp8e4m3_to_fp16(v_raw)  # not v.to(tl.float16): see _fp8.py
            else:
                v = v_raw.to(q.dtype)
            p_sub = tl.where((sub_of_row == sub)[:, None], p, 0.0).to(v.dtype)
            acc = tl.dot(p_sub, v, acc, input_precision=DOT_PRECISION)

    return _merge_rows(m_i, l_i, acc, GROUP, PACK, HEAD_DIM)


@triton.jit
def _merge_rows(m_i, l_i, acc, GROUP: tl.constexpr, PACK: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Each head's PACK rows merged (weights exp2(m_row - m_head); rows without keys weigh 0):
    (out [GROUP, HEAD_DIM], normalised; lse [GROUP], log2 domain)."""
    m_rows = tl.reshape(m_i, [PACK, GROUP])
    m_head = tl.max(m_rows, 0)
    m_head_use = tl.where(m_head == float("-inf"), 0.0, m_head)
    weights = tl.where(m_rows == float("-inf"), 0.0, tl.exp2(m_rows - m_head_use[None, :]))
    l_head = tl.sum(tl.reshape(l_i, [PACK, GROUP]) * weights, 0)
    acc_head = tl.sum(tl.reshape(acc, [PACK, GROUP, HEAD_DIM]) * weights[:, :, None], 0)
    # Only an empty range leaves l == 0: zeros, and an lse of -inf.
    nonempty = l_head > 0.0
    out = acc_head / tl.where(nonempty, l_head, 1.0)[:, None]
    lse = tl.where(nonempty, m_head + tl.log2(tl.where(nonempty, l_head, 1.0)), float("-inf"))
    return out, lse


@triton.jit(do_not_specialize=["window"])
def _decode_packed_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], head-major
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
    window,  # SLIDING: the query sees the last `window` keys
    softcap_in,  # SOFTCAP: scale / softcap
    softcap_out,  # SOFTCAP: softcap * log2(e)
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head, a power of two
    PACK: tl.constexpr,  # sub-partitions side by side; PACK * GROUP rows (>= 16, tl.dot's M)
    HEAD_DIM: tl.constexpr,  # a power of two
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,  # keys per sub-tile; an iteration visits PACK * BLOCK_N
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # float8 cache, bf16 query: dots in fp16 (see _device.fp16_dots)
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Partitions of whole iterations from the window's first one: sub-tiles stay BLOCK_N-aligned.
    lo, tile_lo = _window_start(seq_len, window, PACK * BLOCK_N, SLIDING)
    partition_size, num_valid = _partition(seq_len - tile_lo, num_splits, PACK * BLOCK_N)
    if SPLIT:  # noqa: SIM102 (resolved at compile time; the inner `if` is the device's)
        if split >= num_valid:
            _mark_unused_split(
                part_lse_ptr, seq, kv_head, split, num_splits, NUM_KV_HEADS, GROUP, GROUP
            )
            return
    start = tile_lo + split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    out, lse = _attend_packed(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, start, end, qk_scale,
        stride_q_seq, stride_q_head, stride_bt_seq, lo, softcap_in, softcap_out, NUM_KV_HEADS,
        GROUP, PACK, HEAD_DIM, BLOCK_SIZE, BLOCK_N, DOT_PRECISION, FP16_DOTS, SLIDING, SOFTCAP,
    )  # fmt: skip
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + tl.arange(0, GROUP)
    if SPLIT:
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
