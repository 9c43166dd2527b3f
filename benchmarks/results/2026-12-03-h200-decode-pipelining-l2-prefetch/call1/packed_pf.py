"""Experiment: the packed float8 decode kernel with its loads pipelined by hand in registers.

Today's packed kernel leaves the K/V loads to Triton's pipeliner: with num_stages 2 the buffers
are one deep (the next tile's cp.async is issued after the current tile's compute and waited on at
the top of the next iteration, so nothing of one program overlaps its own loads). Here:
- a program's PACK * BLOCK_N keys are one [T, HEAD_DIM] tile; scores are the whole q @ K^T
  ([16, T]) with the keys outside a row's sub-partition masked to -inf (block-diagonal P), so
  P @ V needs no selection either;
- V of tile i is issued at the top of iteration i (consumed after the softmax), K of tile i + 1
  before P @ V of tile i, and the block ids two tiles ahead: every load has a phase of compute
  between its issue and its first use.
"""

import triton
import triton.language as tl

from kiln.kernels.triton._decode_partition import _partition
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16


@triton.jit
def _slots(block_table, n0, offs, end, BLOCK_SIZE: tl.constexpr):
    n = n0 + offs
    block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n < end, other=0).to(tl.int64)
    return block_ids * BLOCK_SIZE + n % BLOCK_SIZE


@triton.jit
def _tile(cache_ptr, slots, n0, offs, end, head_offset, dims,
          NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr):
    n_mask = (n0 + offs) < end
    offsets = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + head_offset + dims[None, :]
    return tl.load(cache_ptr + offsets, mask=n_mask[:, None], other=0.0)


@triton.jit
def _decode_packed_pf_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, out_ptr, part_out_ptr,
    part_lse_ptr, qk_scale, stride_q_seq, stride_q_head, stride_o_seq, stride_o_head,
    stride_bt_seq, num_splits,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, PACK: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr, FP16_DOTS: tl.constexpr,
    HEADS_FIRST: tl.constexpr, K_ASM: tl.constexpr = False, NATURAL: tl.constexpr = False,
):
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    T: tl.constexpr = PACK * BLOCK_N
    partition_size, num_valid = _partition(seq_len, num_splits, T)
    if SPLIT:  # noqa: SIM102
        if split >= num_valid:
            return
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    ROWS: tl.constexpr = PACK * GROUP
    rows = tl.arange(0, ROWS)
    sub_of_row = rows // GROUP
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq
        + (kv_head * GROUP + rows % GROUP)[:, None] * stride_q_head + dims[None, :]
    )
    if FP16_DOTS:
        q = q.to(tl.float16)
    offs = tl.arange(0, T)
    sub_of_key = offs // BLOCK_N
    own = sub_of_row[:, None] == sub_of_key[None, :]  # [ROWS, T]: the block diagonal
    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head * HEAD_DIM

    if NATURAL:
        slots = _slots(block_table, start, offs, end, BLOCK_SIZE)
        for n_start in range(start, end, T):
            slots_next = _slots(block_table, n_start + T, offs, end, BLOCK_SIZE)
            k = _tile(k_cache_ptr, slots, n_start, offs, end, head_offset, dims, NUM_KV_HEADS,
                      HEAD_DIM)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            n = n_start + offs
            s = tl.where(own & (n < end)[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            acc = acc * alpha[:, None]
            v_raw = _tile(v_cache_ptr, slots, n_start, offs, end, head_offset, dims, NUM_KV_HEADS,
                          HEAD_DIM)
            if FP16_DOTS:
                v = fp8e4m3_to_fp16(v_raw)
            else:
                v = v_raw.to(q.dtype)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            slots = slots_next
    else:
        slots = _slots(block_table, start, offs, end, BLOCK_SIZE)
        slots_next = _slots(block_table, start + T, offs, end, BLOCK_SIZE)
        k = _tile(k_cache_ptr, slots, start, offs, end, head_offset, dims, NUM_KV_HEADS, HEAD_DIM)
        for n_start in range(start, end, T):
            v_raw = _tile(v_cache_ptr, slots, n_start, offs, end, head_offset, dims, NUM_KV_HEADS,
                          HEAD_DIM)
            slots_after = _slots(block_table, n_start + 2 * T, offs, end, BLOCK_SIZE)
            if FP16_DOTS and K_ASM:
                kw = fp8e4m3_to_fp16(k)
            else:
                kw = k.to(q.dtype)
            s = tl.dot(q, tl.trans(kw), input_precision=DOT_PRECISION)  # [ROWS, T]
            n = n_start + offs
            s = tl.where(own & (n < end)[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_use)
            p = tl.exp2(s - m_use[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            acc = acc * alpha[:, None]
            k = _tile(k_cache_ptr, slots_next, n_start + T, offs, end, head_offset, dims,
                      NUM_KV_HEADS, HEAD_DIM)
            if FP16_DOTS:
                v = fp8e4m3_to_fp16(v_raw)
            else:
                v = v_raw.to(q.dtype)
            acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
            slots = slots_next
            slots_next = slots_after

    m_rows = tl.reshape(m_i, [PACK, GROUP])
    m_head = tl.max(m_rows, 0)
    m_head_use = tl.where(m_head == float("-inf"), 0.0, m_head)
    weights = tl.where(m_rows == float("-inf"), 0.0, tl.exp2(m_rows - m_head_use[None, :]))
    l_head = tl.sum(tl.reshape(l_i, [PACK, GROUP]) * weights, 0)
    acc_head = tl.sum(tl.reshape(acc, [PACK, GROUP, HEAD_DIM]) * weights[:, :, None], 0)
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
            out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
        )


import torch
from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton._device import dot_precision, fp16_dots


def decode_pf(query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, tiles,
              num_splits=None, k_asm=False, heads_first=False, natural=False, stages=1):
    """paged_decode_attention through the hand-pipelined packed kernel; tiles (BLOCK_N, warps)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if num_splits is None:
        num_splits = da.choose_num_splits(num_seqs, num_kv_heads, max_seq_len,
                                          torch.cuda.get_device_properties(0).multi_processor_count
                                          if query.is_cuda else 1)
    out = torch.empty_like(query)
    group = num_heads // num_kv_heads
    pack = 16 // group
    block_n, warps = tiles
    split = num_splits > 1
    part_out, part_lse = da._split_buffers(query, num_splits) if split else (out, out)
    grid = da._grid(num_seqs, num_kv_heads, num_splits, heads_first)
    _decode_packed_pf_kernel[grid](
        *da._pointer_args(query, k_cache, v_cache, block_tables, seq_lens, out, part_out,
                          part_lse, scale, num_splits),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, PACK=pack, HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype), FP16_DOTS=fp16_dots(query, k_cache),
        HEADS_FIRST=heads_first, K_ASM=k_asm, NATURAL=natural, num_warps=warps, num_stages=stages,
    )
    if split:
        da._reduce(part_out, part_lse, seq_lens, out, num_splits, pack * block_n)
    return out
