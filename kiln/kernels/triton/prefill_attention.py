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
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE, uses_fp8_qk
from kiln.kernels.triton._attention_kinds import kind_args
from kiln.kernels.triton._device import (
    dot_precision,
    fp16_dots,
    num_sms,
    output_like,
    unit_stride_rows,
)
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16
from kiln.kernels.triton._kv_layout import kv_head_offset as kv_head_offset_of
from kiln.kernels.triton._kv_layout import kv_tile_offsets
from kiln.kernels.triton._online_softmax import (
    online_softmax_update,
    online_softmax_update_masked,
    online_softmax_update_rows,
    soft_cap,
)
from kiln.kernels.triton.fp8_gemm import scaled_to_e4m3

try:  # the sm_90 kernel is Gluon's (Triton >= 3.6); older Tritons keep this file's everywhere
    from kiln.kernels.triton import prefill_attention_hopper
except ImportError:  # pragma: no cover (the tested Tritons have Gluon)
    prefill_attention_hopper = None  # type: ignore[assignment]

_LOG2E = 1.4426950408889634
_FP8_MAX = tl.constexpr(FP8_E4M3_MAX)
_FP8_MIN_SCALE = tl.constexpr(FP8_MIN_SCALE)


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_scale,  # FP8_QK: [BLOCK_M] each query row's float8 scale (else unused)
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
    FP8_QK: tl.constexpr = False,
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
    k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0)
    if FP8_QK:
        s = tl.dot(q, tl.trans(k))  # float8 x float8, fp32 sums: [BLOCK_M, BLOCK_N], unscaled
    else:
        s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
    if FP16_DOTS:  # noqa: SIM108 (resolved at compile time)
        v = fp8e4m3_to_fp16(v)  # not v.to(tl.float16): see _fp8.py
    else:
        v = v.to(q.dtype if not FP8_QK else tl.float32)
    if SOFTCAP:  # scaled and capped here, in the log2 domain: the update then scales by 1
        if FP8_QK:
            s = s * q_scale[:, None]
        s = soft_cap(s, softcap_in, softcap_out)
        qk_scale = 1.0
    if MASKED:
        visible = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
        if SLIDING:
            visible = visible & (n[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    if FP8_QK:
        if SOFTCAP:  # noqa: SIM108 (resolved at compile time)
            row_scale = tl.full(q_scale.shape, 1.0, tl.float32)
        else:
            row_scale = q_scale * qk_scale
        acc, l_i, m_i = online_softmax_update_rows(
            acc, l_i, m_i, s, row_scale, v, DOT_PRECISION, SLIDING and MASKED
        )
        return acc, l_i, m_i
    if SLIDING and MASKED:
        # A row may see no key of this tile and none before it (its window starts later).
        acc, l_i, m_i = online_softmax_update_masked(acc, l_i, m_i, s, qk_scale, v, DOT_PRECISION)
    else:
        # Rows fully masked in this tile keep m_i (finite: every row saw a key in an earlier
        # tile). The scale goes in inside the update, after the row maxima: one FFMA a score.
        acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, qk_scale, v, DOT_PRECISION)
    return acc, l_i, m_i


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
    FP8_QK: tl.constexpr = False,  # float8 cache: Q per row to e4m3, Q @ K^T a float8 dot
    INTERPRETED: tl.constexpr = False,  # the Triton interpreter: see round_to_e4m3_grid
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
    q_scale = tl.full([BLOCK_M], 1.0, tl.float32)
    if FP8_QK:
        # Each (token, head) row to e4m3 with its own absmax / 448 (reference.quantize_fp8's
        # rounding): finer than a scale per tile or head and no dearer, since a row's scale
        # joins the one multiply-add each score gets anyway.
        q = q.to(tl.float32)
        absmax = tl.max(tl.abs(q), 1)
        q_scale = tl.maximum(tl.math.div_rn(absmax, _FP8_MAX), _FP8_MIN_SCALE)
        inv_scale = tl.math.div_rn(1.0, q_scale)
        q = scaled_to_e4m3(q, q_scale[:, None], inv_scale[:, None], True, _FP8_MAX, INTERPRETED)
        q = q.to(k_cache_ptr.dtype.element_ty)
    elif FP16_DOTS:
        q = q.to(tl.float16)
    q_pos = context_len + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if SINKS:  # the sink as a first key of weight exp(sink) and value 0: m and l start there
        sink = tl.full([BLOCK_M], 0.0, tl.float32) + tl.load(sinks_ptr + head) * 1.4426950408889634
        m_i = sink
        l_i = tl.exp2(sink - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    kv_head_offset = kv_head_offset_of(head // GROUP, HEAD_DIM, BLOCK_SIZE)

    # Keys before the tile's first query position are visible to all its rows (and all < seq_len).
    first_pos = context_len + m_block * BLOCK_M
    unmasked_end = (first_pos // BLOCK_N) * BLOCK_N
    full_start = 0
    lo = 0
    # The diagonal's end: keys from here on are past every row of the tile.
    causal_end = tl.minimum(seq_len, first_pos + BLOCK_M)
    if SLIDING:
        # Keys before the first row's window are skipped; tiles before the last row's window
        # start are masked per row; from there to the diagonal every row sees every key.
        lo = tl.maximum(first_pos - window + 1, 0)
        last_pos = context_len + tl.minimum(m_block * BLOCK_M + BLOCK_M, q_len) - 1
        full_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        full_start = tl.maximum(tl.minimum(full_start, unmasked_end), (lo // BLOCK_N) * BLOCK_N)
    if SLIDING:
        for n_start in range((lo // BLOCK_N) * BLOCK_N, full_start, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_scale, q_pos, n_start, seq_len, lo, window, softcap_in,
                softcap_out, block_table, k_cache_ptr, v_cache_ptr, kv_head_offset, dims, dim_mask,
                qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
                FP16_DOTS, SLIDING, SOFTCAP, FP8_QK,
            )  # fmt: skip
    for n_start in range(full_start, unmasked_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_scale, q_pos, n_start, seq_len, lo, window, softcap_in,
            softcap_out, block_table, k_cache_ptr, v_cache_ptr, kv_head_offset, dims, dim_mask,
            qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION, FP16_DOTS,
            SLIDING, SOFTCAP, FP8_QK,
        )  # fmt: skip
    # The diagonal: the first of these tiles holds key `first_pos`, seen by every row.
    for n_start in range(unmasked_end, causal_end, BLOCK_N):
        acc, l_i, m_i = _attend_tile(
            acc, l_i, m_i, q, q_scale, q_pos, n_start, seq_len, lo, window, softcap_in,
            softcap_out, block_table, k_cache_ptr, v_cache_ptr, kv_head_offset, dims, dim_mask,
            qk_scale, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION, FP16_DOTS,
            SLIDING, SOFTCAP, FP8_QK,
        )  # fmt: skip

    if SLIDING:  # padding rows past the chunk may have seen no key: no 0 / 0 (never stored)
        l_i = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & dim_mask[None, :],
    )


# Tiles for prompts with many query tiles, keyed by (head_dim up to, how the K/V operands run):
# (BLOCK_M, BLOCK_N, num_warps, num_stages).
#   head_dim <= 128, "bf16"        128 x 64, 4 warps, 3 stages (H200 bf16, 8k prompt: 397 TFLOP/s
#                                  against 380 for 64-row tiles; compiled by Triton 3.9 it
#                                  spills 1.7 KB a thread, 8 warps none: the sweep's first check)
#   head_dim <= 128, "fp8_widened" 128 x 128, 8 warps, 2 stages (float8 K/V widened to 16 bits:
#                                  best or within 2% of 18 tiles at 2k prompts and a 512-token
#                                  chunk after 6k, H200)
#   head_dim <= 128, "fp8_qk"      128 x 128, 8 warps, 2 stages (float8 Q.K dots, V widened:
#                                  474 TFLOP/s at a 16k causal prompt on an H100; to be
#                                  confirmed by benchmarks/kernels_gpu.py --long's sweep)
#   head_dim <= 256, any           64 x 32, 4 warps, 2 stages (keeps the stages in shared memory)
# Fewer tiles than 8 programs an SM (short prompts, bf16) take 64 x 64 tiles, which balance the
# causal triangle's uneven work better (2k prompt: 275 against 207 TFLOP/s; a 512-token chunk
# after a 6k prefix: 349 against 252).
PREFILL_TILES: dict[tuple[int, str], tuple[int, int, int, int]] = {
    (128, "bf16"): (128, 64, 4, 3),
    (128, "fp8_widened"): (128, 128, 8, 2),
    (128, "fp8_qk"): (128, 128, 8, 2),
    (256, "bf16"): (64, 32, 4, 2),
    (256, "fp8_widened"): (64, 32, 4, 2),
    (256, "fp8_qk"): (64, 32, 4, 2),
}
_FEW_TILES = (64, 64, 4, 3)


def _tile_config(
    head_dim: int,
    max_query_len: int,
    num_heads: int,
    num_seqs: int,
    device: torch.device,
    operands: str = "bf16",  # a PREFILL_TILES operand kind
) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) from PREFILL_TILES."""
    if device.type != "cuda":
        return 16, 16, 4, 1  # the interpreter's cost grows with tile size; 16 is tl.dot's minimum
    if head_dim > 256:
        # MLA's 576-wide latent rows (1024-wide tiles): the interpreter's tiles, one stage, so
        # Q, K and V tiles fit shared memory; untimed, and not yet compiled on a GPU.
        return 16, 16, 8, 1
    key = (128 if head_dim <= 128 else 256, operands)
    few = triton.cdiv(max_query_len, 128) * num_heads * num_seqs < 8 * num_sms(device)
    if key[0] == 128 and operands == "bf16" and few:
        return _FEW_TILES
    return PREFILL_TILES[key]


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
    fp8_qk: bool = False,  # float8 cache: Q @ K^T as a float8 dot (else K widened)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention for chunks whose earlier context is already in the cache (a window, a
    soft-cap, sinks and float8 dots as the twin's; without them the kernel compiles as it always
    did). The Gluon sm_90 kernel takes the calls prefill_attention_hopper.applies() selects."""
    hopper = prefill_attention_hopper
    if hopper is not None and hopper.applies(query, k_cache, window, softcap, sinks, fp8_qk):
        return hopper.paged_prefill_attention(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale,
            max_query_len, max_seq_len, out, fp8_qk,
        )  # fmt: skip
    return triton_paged_prefill_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, max_query_len,
        max_seq_len, out, window, softcap, sinks, fp8_qk,
    )  # fmt: skip


def triton_paged_prefill_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    fp8_qk: bool = False,
) -> torch.Tensor:
    """paged_prefill_attention in plain Triton, on any GPU (and the interpreter)."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    check_head_major(k_cache, v_cache)
    out = output_like(query, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    query, block_tables = unit_stride_rows(query, block_tables)
    kv_fp8 = k_cache.element_size() == 1  # float8 or int8: K and V widened alike
    fp8_qk = uses_fp8_qk(fp8_qk, k_cache)
    operands = ("fp8_qk" if fp8_qk else "fp8_widened") if kv_fp8 else "bf16"
    block_m, block_n, num_warps, num_stages = _tile_config(
        head_dim, max_query_len, num_heads, num_seqs, query.device, operands
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
        # Only a float8-dot launch passes these: the other kernels compile as they did.
        **({"FP8_QK": True, "INTERPRETED": query.device.type != "cuda"} if fp8_qk else {}),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
