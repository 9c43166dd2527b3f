"""Paged prefill attention over packed chunks (twin of reference.paged_prefill_attention).

Flash-attention style: one program per (tile of BLOCK_M query tokens of one sequence, query head);
keys and values come from the paged cache through the block table (cached prefix, earlier chunks
and this chunk alike), with an online softmax in fp32. The j-th of a sequence's q_len queries sits
at position seq_len - q_len + j and sees every key at or before it. Key tiles wholly before a query
tile's first position need no causal mask, so they run in a separate, mask-free loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.kv_layout import check_head_major
from kiln.kernels.triton._attention_kinds import kind_args
from kiln.kernels.triton._device import dot_precision, fp16_dots, num_sms, output_like
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16
from kiln.kernels.triton._kv_layout import kv_head_offset as kv_head_offset_of
from kiln.kernels.triton._kv_layout import kv_tile_offsets
from kiln.kernels.triton._online_softmax import (
    online_softmax_update,
    online_softmax_update_masked,
    soft_cap,
)

_LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,  # [BLOCK_M] position of each query row in its sequence
    n_start,
    seq_len,
    lo,  # SLIDING: the first key any row of the tile sees (keys before it are never read)
    window,
    softcap_in,
    softcap_out,
    block_table,  # pointer to this sequence's row of the block table
    k_cache_ptr,
    v_cache_ptr,
    kv_head_offset,
    dims,
    dim_mask,
    qk_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,  # apply the causal / end-of-context (and window) mask
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    n = n_start + tl.arange(0, BLOCK_N)
    if MASKED:
        n_mask = n < seq_len
        if SLIDING:  # a block the window left behind may be another request's by now
            n_mask = n_mask & (n >= lo)
        block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n_mask, other=0)
    else:
        n_mask = tl.full([BLOCK_N], 1, tl.int1)  # the whole tile lies before seq_len
        block_ids = tl.load(block_table + n // BLOCK_SIZE)
    kv_offsets = kv_tile_offsets(
        block_ids.to(tl.int64), n % BLOCK_SIZE, kv_head_offset, dims, NUM_KV_HEADS, HEAD_DIM,
        BLOCK_SIZE,
    )  # fmt: skip
    kv_mask = n_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if FP16_DOTS:  # noqa: SIM108 (resolved at compile time)
        v = fp8e4m3_to_fp16(v)  # not v.to(tl.float16): see _fp8.py
    else:
        v = v.to(q.dtype)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    if SOFTCAP:  # scaled and capped here, in the log2 domain: the update then scales by 1
        s = soft_cap(s, softcap_in, softcap_out)
        qk_scale = 1.0
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if SLIDING and MASKED:
        # A row may see no key of this tile and none before it (its window starts later).
        return online_softmax_update_masked(acc, l_i, m_i, s, qk_scale, v, DOT_PRECISION)
    # Rows fully masked in this tile keep m_i (finite: every row saw a key in an earlier tile).
    # The scale goes in inside the update, after the row maxima: one FFMA a score.
    return online_softmax_update(acc, l_i, m_i, s, qk_scale, v, DOT_PRECISION)


@triton.jit(do_not_specialize=["window"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], head-major
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e): the softmax runs on exp2
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_bt_seq,
    window,  # SLIDING: each query sees the last `window` positions up to its own
    softcap_in,  # SOFTCAP: scale / softcap
    softcap_out,  # SOFTCAP: softcap * log2(e)
    sinks_ptr,  # SINKS: [num_heads] fp32 logits that join each head's softmax denominator
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # float8 cache, bf16 query: dots in fp16 (see _device.fp16_dots)
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    SINKS: tl.constexpr = False,
):
    # Reversed so the longest (last, most keys under the causal mask) tiles start first.
    m_block = tl.num_programs(0) - 1 - tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return  # the grid covers the longest chunk; this sequence's is shorter
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # keys already cached before this chunk

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    dims = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # noqa: SIM108 (plain if/else: resolved at compile time)
        # A constant mask lets the compiler vectorise the loads along head_dim.
        dim_mask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dim_mask = dims < HEAD_DIM
    tokens = (q_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
        mask=m_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if FP16_DOTS:
        q = q.to(tl.float16)
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink as a first key of weight exp(sink) and value 0: m and l start there
        m_i = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head) * 1.4426950408889634
        l_i = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_head_offset = kv_head_offset_of(head // GROUP, HEAD_DIM, BLOCK_SIZE)

    # Keys before the tile's first query position are visible to all its rows (and all < seq_len).
    first_pos = context_len + m_block * BLOCK_M
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    full_start = 0
    lo = 0
    if SLIDING:
        # Keys before the first row's window are skipped; tiles before the last row's window
        # start are masked per row; from there to the diagonal every row sees every key.
        lo = tl.maximum(first_pos - window + 1, 0)
        last_pos = context_len + tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len) - 1
        full_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_start = tl.maximum(tl.minimum(full_start, unmasked_end), (lo // BLOCK_N) * BLOCK_N)
        for n_start in range((lo // BLOCK_N) * BLOCK_N, full_start, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, n_start, seq_len, lo, window, softcap_in, softcap_out,
                block_table, k_cache_ptr, v_cache_ptr, kv_head_offset, dims, dim_mask, qk_scale,
                NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, FP16_DOTS,
                SLIDING, SOFTCAP,
            )  # fmt: skip
    for n_start in range(full_start, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, n_start, seq_len, lo, window, softcap_in, softcap_out,
            block_table, k_cache_ptr, v_cache_ptr, kv_head_offset, dims, dim_mask, qk_scale,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, FP16_DOTS,
            SLIDING, SOFTCAP,
        )  # fmt: skip
    # The diagonal: the first of these tiles holds key `first_pos`, seen by every row.
    causal_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    for n_start in range(unmasked_end, causal_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_pos, n_start, seq_len, lo, window, softcap_in, softcap_out,
            block_table, k_cache_ptr, v_cache_ptr, kv_head_offset, dims, dim_mask, qk_scale,
            NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, FP16_DOTS,
            SLIDING, SOFTCAP,
        )  # fmt: skip

    if SLIDING:  # padding rows past the chunk may have seen no key: no 0 / 0 (never stored)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & dim_mask[None, :],
    )


def _tile_config(
    head_dim: int,
    max_query_len: int,
    num_heads: int,
    num_seqs: int,
    device: torch.device,
    kv_fp8: bool = False,
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages).

    Measured on an H200 (Llama-3.1-8B heads, bf16): 128-row tiles win once there are many of them
    (8k-token prompt: 397 TFLOP/s against 380 for 64-row ones); with fewer, 64-row tiles balance
    the causal triangle's uneven work better (2k prompt: 275 against 207 TFLOP/s; a 512-token
    chunk after a 6k prefix: 349 against 252).
    """
    if device.type != "cuda":
        return 16, 16, 4, 1  # the interpreter's cost grows with tile size; 16 is tl.dot's minimum
    if head_dim > 128:
        return 64, 32, 4, 2  # keep the K/V stages within shared memory
    if kv_fp8:
        # Float8 K/V: 128 x 128 tiles on 8 warps were best or within 2% for four 2k prompts and a
        # 512-token chunk after 6k (274 and 318 TFLOP/s; bf16 322 and 338), where the bf16 choices
        # gave 260 and 242 (fp8_run3/kv_fp8_kernel_sweep.json, before V was widened by _fp8.py;
        # with it, 270 and 319 at this tile in fp8_run7, whose re-sweep failed on a script bug).
        return 128, 128, 8, 2
    if triton.cdiv(max_query_len, 128) * num_heads * num_seqs >= 8 * num_sms(device):
        return 128, 64, 4, 3
    return 64, 64, 4, 3


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # written and returned when given (a slice of a larger one)
    window: int | None = None,  # sliding window: only the last `window` keys (itself included)
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32 learned logits in the denominator
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention for chunks whose earlier context is already in the cache (a window, a
    soft-cap and sinks as the twin's; without them the kernel compiles as it always did)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    check_head_major(k_cache, v_cache)
    out = output_like(query, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    block_m, block_n, num_warps, num_stages = _tile_config(
        head_dim,
        max_query_len,
        num_heads,
        num_seqs,
        query.device,
        kv_fp8=k_cache.dtype == torch.float8_e4m3fn,
    )
    grid = (triton.cdiv(max_query_len, block_m), num_heads, num_seqs)
    _prefill_kernel[grid](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        *kind_args(query, scale, window, softcap, sinks),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        FP16_DOTS=fp16_dots(query, k_cache),
        SLIDING=window is not None,
        SOFTCAP=softcap is not None,
        SINKS=sinks is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
