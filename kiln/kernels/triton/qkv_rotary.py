"""The attention block's input at batch-1 decode in one kernel: residual add + RMSNorm, the fused
qkv projection, rotary embedding, and this step's key/value into the paged cache (twin of
reference.add_rms_norm_qkv_rotary_write_kv).

Unfused that is the normed qkv kernel, then the rotary/KV-write kernel: at batch 1 the second is a
~2 us kernel over a few kilobytes plus a launch gap, per layer (H200, Llama-3.1-8B). Here each
program owns BLOCK_N rotate-half pairs of output columns (column c of a head and c + head_dim / 2)
and streams the weight rows of both, like the gated gate_up kernel (small_batch_linear), so the
rotation happens on its accumulators. Query columns go out rotated; key columns are rotated and
written to the token's cache slot; value columns are written as they are. Rounded as the unfused
path: the projection to the model dtype, the rotation in fp32 back to it, then to the cache's
dtype (float8 saturating at +-448).

More rows (and operands the kernel does not take) run the unfused ops.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.kv_layout import check_head_major
from kiln.kernels.reference import FP8_E4M3_MAX, split_qkv_heads
from kiln.kernels.triton import small_batch_tiles, split_k
from kiln.kernels.triton._device import dot_precision
from kiln.kernels.triton._int8_kv import is_int8_cache
from kiln.kernels.triton._kv_layout import kv_head_offset, kv_slot_base
from kiln.kernels.triton.rms_norm import lone_x_norm
from kiln.kernels.triton.rotary import _to_output, rotary_embedding_write_kv
from kiln.kernels.triton.small_batch_linear import (
    _ADD_NORM,
    _NORM,
    _fp8_dot,
    _fused_norm_fits,
    _project,
    _quant_mode,
    _rows_2d,
    _write_residual_sum,
    _x_inv_rms,
    add_rms_norm_linear,
    swap_ab,
)


@triton.jit
def _cache_columns(
    slot, columns, KV_SIZE: tl.constexpr, HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """Element offsets in a K or V cache of the token at `slot` (int64): columns (head * head_dim
    + dim) of its KV_SIZE-long row."""
    base = kv_slot_base(slot, KV_SIZE // (2 * HALF), 2 * HALF, BLOCK_SIZE)
    head = columns // (2 * HALF)
    return base + kv_head_offset(head, 2 * HALF, BLOCK_SIZE) + columns % (2 * HALF)


@triton.jit
def _qkv_rotary_write_kv_kernel(
    x_ptr,  # [1, K]
    residual_ptr,  # [1, K], read when ADD_NORM
    norm_weight_ptr,  # [K]
    w_ptr,  # [Q_SIZE + 2 * KV_SIZE, K], contiguous
    bias_ptr,  # [Q_SIZE + 2 * KV_SIZE], read when HAS_BIAS
    sum_ptr,  # [1, K]: x + residual, written when ADD_NORM
    positions_ptr,  # [1] int64
    cos_sin_ptr,  # [max_positions, 2 * HALF] fp32, contiguous
    q_out_ptr,  # [Q_SIZE]: the rotated query
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], head-major
    v_cache_ptr,
    slot_mapping_ptr,  # [1] int64; negative: a padding token, not written
    w_scale_ptr,  # [Q_SIZE + 2 * KV_SIZE] fp32 per-row weight scales, read when QUANT
    in_scale_ptr,  # [] fp32 static activation scale, read when QUANT == 2
    part_ptr,  # [SPLIT_K, 2, (Q_SIZE + 2 * KV_SIZE) // 2] fp32 partial sums, when SPLIT_K > 1
    counter_ptr,  # [number of pair tiles] int32 zeros (split_k.counters), when SPLIT_K > 1
    K,
    k_per_split,  # K when SPLIT_K is 1
    eps,
    Q_SIZE: tl.constexpr,
    KV_SIZE: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,  # column pairs per program
    BLOCK_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per pair tile, program_id(1) the split (split_k.py)
    DOT_PRECISION: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0 for a float8 cache
    INT8: tl.constexpr,  # an int8 cache
    QUANT: tl.constexpr,  # 0, or float8 weights with dynamic (1) / static (2) activations
    FP8_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SWAP_AB: tl.constexpr,  # small_batch_linear._times
    BLOCK_SIZE: tl.constexpr,  # the cache's
    x_norm_weight_ptr=None,  # [K], read when X_NORM
    X_NORM: tl.constexpr = False,  # ADD_NORM of x RMS-normed first (reference.sandwich_input)
):
    tl.static_assert(SPLIT_K == 1 or QUANT != 0, "bf16 norm: no split-K")
    num_pairs: tl.constexpr = (Q_SIZE + 2 * KV_SIZE) // 2
    pairs = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pair_mask = pairs < num_pairs
    dims = pairs % HALF  # the rotary frequency of the pair
    lo = (pairs // HALF) * (2 * HALF) + dims  # the pair's first column; its partner is lo + HALF
    w_lo = w_ptr + lo[:, None].to(tl.int64) * K
    k_start, k_stop = split_k.k_range(K, k_per_split, SPLIT_K)
    # The epilogue's loads issued before the weight stream: after it (behind the split-K
    # hand-off's acquire) the position, then its cos/sin, were two more round trips at the end of
    # the tile's last program, where nothing else is in flight.
    w_scale_lo = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_scale_hi = tl.zeros([BLOCK_N], dtype=tl.float32)
    if QUANT != 0:
        w_scale_lo = tl.load(w_scale_ptr + lo, mask=pair_mask, other=0.0)
        w_scale_hi = tl.load(w_scale_ptr + lo + HALF, mask=pair_mask, other=0.0)
    bias_lo = tl.zeros([BLOCK_N], dtype=tl.float32)
    bias_hi = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias_lo = tl.load(bias_ptr + lo, mask=pair_mask, other=0.0).to(tl.float32)
        bias_hi = tl.load(bias_ptr + lo + HALF, mask=pair_mask, other=0.0).to(tl.float32)
    position = tl.load(positions_ptr).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + dims, mask=pair_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + dims, mask=pair_mask, other=0.0)
    slot = tl.load(slot_mapping_ptr).to(tl.int64)
    inv_rms_x = 0.0
    if X_NORM:  # the row's x-norm scale, before the weight's stream (its chunks need it)
        inv_rms_x = _x_inv_rms(x_ptr, K, eps, STATS_BLOCK)
    acc_lo, acc_hi = _project(
        x_ptr, residual_ptr, norm_weight_ptr, w_ptr, w_lo, w_lo + HALF * K, pair_mask, sum_ptr,
        in_scale_ptr, 1, K, k_start, k_stop, 0, eps, PROLOGUE, True, 16, BLOCK_N, BLOCK_K,
        STATS_BLOCK, DOT_PRECISION, QUANT, FP8_DOT, INTERPRETED, SWAP_AB=SWAP_AB,
        x_norm_weight_ptr=x_norm_weight_ptr, inv_rms_x=inv_rms_x, X_NORM=X_NORM,
    )  # fmt: skip
    if PROLOGUE == 2:
        _write_residual_sum(x_ptr, residual_ptr, sum_ptr, K, BLOCK_K, x_norm_weight_ptr,
                            inv_rms_x, X_NORM)  # fmt: skip
    # Row 0 of the dot's tiles (the other rows are exact zeros: their inputs were).
    out_lo = tl.sum(acc_lo, 0)
    out_hi = tl.sum(acc_hi, 0)
    if SPLIT_K > 1:
        # The pairs' sums over all K: complete in the program that arrives last, the only one
        # whose stores below are unmasked (pair_mask carries it).
        mine = part_ptr + tl.program_id(1) * (2 * num_pairs)
        tl.store(mine + pairs, out_lo, mask=pair_mask)
        tl.store(mine + num_pairs + pairs, out_hi, mask=pair_mask)
        pair_mask = pair_mask & split_k.arrive(counter_ptr, tl.program_id(0), pairs, SPLIT_K)
        out_lo = split_k.sum_partials(part_ptr, pairs, pair_mask, 2 * num_pairs, SPLIT_K)
        out_hi = split_k.sum_partials(
            part_ptr + num_pairs, pairs, pair_mask, 2 * num_pairs, SPLIT_K
        )
    if QUANT != 0:  # the weight's per-row scales, after the sum as reference.fp8_linear
        out_lo *= w_scale_lo
        out_hi *= w_scale_hi
    if HAS_BIAS:
        out_lo += bias_lo
        out_hi += bias_hi
    dtype = q_out_ptr.dtype.element_ty
    x1 = out_lo.to(dtype).to(tl.float32)  # the projection's output, rounded as unfused
    x2 = out_hi.to(dtype).to(tl.float32)
    rot1 = (x1 * cos - x2 * sin).to(dtype)
    rot2 = (x2 * cos + x1 * sin).to(dtype)

    is_q = pair_mask & (lo < Q_SIZE)
    tl.store(q_out_ptr + lo, rot1, mask=is_q)
    tl.store(q_out_ptr + lo + HALF, rot2, mask=is_q)
    if slot >= 0:
        is_k = pair_mask & (lo >= Q_SIZE) & (lo < Q_SIZE + KV_SIZE)
        k_dst = k_cache_ptr + _cache_columns(slot, lo - Q_SIZE, KV_SIZE, HALF, BLOCK_SIZE)
        tl.store(k_dst, _to_output(rot1, k_cache_ptr, FP8_MAX, INT8), mask=is_k)
        tl.store(k_dst + HALF, _to_output(rot2, k_cache_ptr, FP8_MAX, INT8), mask=is_k)
        is_v = pair_mask & (lo >= Q_SIZE + KV_SIZE)
        v_dst = v_cache_ptr + _cache_columns(slot, lo - Q_SIZE - KV_SIZE, KV_SIZE, HALF, BLOCK_SIZE)
        tl.store(v_dst, _to_output(x1.to(dtype), v_cache_ptr, FP8_MAX, INT8), mask=is_v)
        tl.store(v_dst + HALF, _to_output(x2.to(dtype), v_cache_ptr, FP8_MAX, INT8), mask=is_v)


def _qkv_rotary_fits(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    input_scale: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
    k_cache: torch.Tensor,
) -> bool:
    """Whether the one-kernel path takes these operands (else norm + linear, then rotary)."""
    head_dim = cos_sin_cache.shape[1]
    kv_size = k_cache.shape[2] * head_dim
    return (
        _fused_norm_fits(x, residual, norm_weight, weight, weight_scale, input_scale)
        and k_cache.shape[3] == head_dim
        and head_dim % 2 == 0
        and (weight.shape[0] - 2 * kv_size) % head_dim == 0
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.dtype == torch.float32
        and (bias is None or bias.is_contiguous())
    )


def add_rms_norm_qkv_rotary_write_kv(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [q_size + 2 * kv_size, K]: q, k, v projections stacked
    bias: torch.Tensor | None,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    weight_scale: torch.Tensor | None = None,  # [q_size + 2 * kv_size] fp32: FP8 W8A8
    input_scale: torch.Tensor | None = None,  # [] fp32 static; None: dynamic per token
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, num_heads, head_dim], x + residual)
    """(rotated query, x + residual) of add_rms_norm_linear followed by
    rotary_embedding_write_kv; one kernel for one row (float8 weights too; with
    x_norm_weight, x normed first in the same kernel: Gemma 2's sandwich norms)."""
    x, x_norm_weight = lone_x_norm(x, residual, x_norm_weight, eps)
    head_dim = cos_sin_cache.shape[1]
    kv_size = k_cache.shape[2] * head_dim
    if not _qkv_rotary_fits(
        x, residual, norm_weight, weight, bias, weight_scale, input_scale, cos_sin_cache, k_cache
    ):
        qkv, summed = add_rms_norm_linear(
            x, residual, norm_weight, eps, weight, bias, weight_scale, input_scale, x_norm_weight
        )
        query, key, value = split_qkv_heads(qkv, head_dim, k_cache.shape[2])
        rotated = rotary_embedding_write_kv(
            positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
        )
        return rotated, summed
    check_head_major(k_cache, v_cache)
    q_size = weight.shape[0] - 2 * kv_size
    quant = _quant_mode(weight_scale, input_scale, x)
    x2 = _rows_2d(x)
    query = torch.empty((1, q_size // head_dim, head_dim), dtype=x.dtype, device=x.device)
    summed = x if residual is None else torch.empty_like(x2)
    tiles = small_batch_tiles.tile_config(
        "qkv_rotary", weight.shape[0], weight.shape[1], x.device, weight.element_size()
    )
    block_n = tiles.block_n
    if x.device.type == "cuda":
        block_n //= 2  # the same bytes per step: BLOCK_N / 2 pairs of rows
    num_tiles = triton.cdiv(weight.shape[0] // 2, block_n)
    per_split, num_splits = split_k.k_per_split(weight.shape[1], tiles.split_k, tiles.block_k)
    if num_splits > 1 and weight_scale is None:
        raise ValueError(f"qkv_rotary in {x.dtype} takes no split-K (tiles {tiles})")
    part = counters = cos_sin_cache
    if num_splits > 1:
        assert num_tiles <= split_k.MAX_TILES
        part = split_k.partials(num_splits, 2, weight.shape[0] // 2, device=x.device)
        counters = split_k.counters(x.device)
    # Absent optional tensors are passed as another tensor the kernel never reads.
    _qkv_rotary_write_kv_kernel[(num_tiles, num_splits)](
        x2, _rows_2d(residual) if residual is not None else x2, norm_weight, weight,
        bias if bias is not None else weight, summed, positions, cos_sin_cache, query,
        k_cache, v_cache, slot_mapping,
        weight_scale if weight_scale is not None else cos_sin_cache,
        input_scale if input_scale is not None else cos_sin_cache,
        part, counters, weight.shape[1], per_split, eps,
        Q_SIZE=q_size,
        KV_SIZE=kv_size,
        HALF=head_dim // 2,
        PROLOGUE=_NORM if residual is None else _ADD_NORM,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=tiles.block_k,
        STATS_BLOCK=tiles.stats_block or tiles.block_k,
        SPLIT_K=num_splits,
        DOT_PRECISION=dot_precision(x.dtype),
        FP8_MAX=FP8_E4M3_MAX if k_cache.dtype == torch.float8_e4m3fn else 0.0,
        INT8=is_int8_cache(k_cache),
        QUANT=quant,
        FP8_DOT=_fp8_dot(x.device),
        INTERPRETED=x.device.type != "cuda",
        SWAP_AB=swap_ab(quant, block_n, x.device),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **({} if x_norm_weight is None else {"x_norm_weight_ptr": x_norm_weight, "X_NORM": True}),
    )  # fmt: skip
    return query, summed.view(x.shape)
