"""W4A16 GEMM (twin of reference.int4_linear): int4 codes packed 8 to an int32 along K
([N, K / 8], kiln.layers.quantization.int4's layout), dequantized in registers with their group's
scale and zero point, then multiplied in the activations' dtype (fp16 / bf16 tensor-core dots,
fp32 accumulation). The weight is read once per column tile, a quarter of bf16's bytes.

Two kernels: from 9 rows on, tiles of rows through tl.dot on the dequantized weight; 1-8 rows
(decode), _int4_small_batch_kernel, which applies scales and zeros per group instead of per code
(it does not round the dequantized weight to the activations' dtype, so it is at least as exact
as the twin) and splits K over programs to keep enough loads in flight. The 9+ row kernel is not
tuned on a GPU yet. On sm_90, int4_gemm_hopper's Gluon kernel (codes re-laid for mma.sync's
register operand) takes the calls it applies() to."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels.triton import split_k
from kiln.kernels.triton._device import dot_precision, num_sms

try:  # the sm_90 kernel is Gluon's (Triton >= 3.6); older Tritons keep this file's everywhere
    from kiln.kernels.triton import int4_gemm_hopper
except ImportError:  # pragma: no cover (the tested Tritons have Gluon)
    int4_gemm_hopper = None  # type: ignore[assignment]

SMALL_BATCH_ROWS = 8  # up to this many rows: _int4_small_batch_kernel


@triton.jit
def _dequantized_tile(w_ptr, s_ptr, z_ptr, k0, offs_n, N, K, groups, group_size,
                      DTYPE: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, ZERO_IS_MIN: tl.constexpr):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] weight tile of inputs k0.. (one group: the launcher makes BLOCK_K
    divide the group size) and outputs offs_n, as (code - zero) * scale in DTYPE (ZERO_IS_MIN:
    code * scale + min, exact for GGUF's blocks: code * scale takes no rounding). Each int32
    word is loaded once and fanned out to its 8 codes in registers."""
    mask_n = offs_n < N
    offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = (offs_w < K // 8)[:, None] & mask_n[None, :]
    words = tl.load(w_ptr + offs_n[None, :] * (K // 8) + offs_w[:, None], mask=mask, other=0)
    words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)),
                       (BLOCK_K, BLOCK_N))  # fmt: skip
    codes = (words >> ((tl.arange(0, BLOCK_K) % 8) * 4)[:, None]) & 0xF
    group = k0 // group_size
    scale = tl.load(s_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
    zero = tl.load(z_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
    if ZERO_IS_MIN:
        return (codes.to(tl.float32) * scale[None, :] + zero[None, :]).to(DTYPE)
    return ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(DTYPE)


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                      groups, group_size, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, ZERO_IS_MIN: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        w = _dequantized_tile(w_ptr, s_ptr, z_ptr, k0, offs_n, N, K, groups, group_size,
                              x.dtype, BLOCK_K, BLOCK_N, ZERO_IS_MIN)  # fmt: skip
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])  # fmt: skip


@triton.jit
def _int4_small_batch_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, counter_ptr, M,
                             N, K, stride_xm, stride_ym, groups, group_size, k_per_split,
                             HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
                             PRECISION: tl.constexpr, ZERO_IS_MIN: tl.constexpr):  # fmt: skip
    """y = sum over groups of scale * (x . codes - zero * sum(x)): the codes (exact in any float
    dtype) meet the activations unscaled and each group's scale and zero apply once per tile
    step, with no per-code dequantization. Code j of every word (inputs 8w + j) is taken in
    turn, so words are never reshaped across threads. One row (DOT off) multiplies and adds in
    fp32 registers; 2-8 rows, padded to ROWS = 16, take tl.dot per j (K = BLOCK_K / 8 >= 16):
    on an H100 at 8 rows, 178 us a Llama-3.1-8B layer against 551 in registers. ZERO_IS_MIN
    (GGUF's code * scale + min): y sums scale * (x . codes) + min * sum(x) instead."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    WORDS: tl.constexpr = BLOCK_K // 8
    word_ks = tl.arange(0, WORDS)
    k_start, k_stop = split_k.k_range(K, k_per_split, SPLIT_K)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        # A row's BLOCK_K / 2 bytes of codes are contiguous: each row's words load together.
        offs_w = k0 // 8 + word_ks
        w_mask = offs_w < K // 8
        words = tl.load(w_ptr + offs_n[:, None] * (K // 8) + offs_w[None, :],
                        mask=mask_n[:, None] & w_mask[None, :], other=0)  # fmt: skip
        x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_w[None, :] * 8
        x_mask = mask_m[:, None] & w_mask[None, :]
        x_sum = tl.zeros((ROWS, WORDS), dtype=tl.float32)
        if DOT:
            dot = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for j in tl.static_range(8):
                x = tl.load(x_rows + j, mask=x_mask, other=0.0)
                codes = ((words >> (4 * j)) & 0xF).to(x.dtype)
                dot = tl.dot(codes, tl.trans(x), dot, input_precision=PRECISION)
                x_sum += x.to(tl.float32)
        else:
            products = tl.zeros((BLOCK_N, ROWS, WORDS), dtype=tl.float32)
            for j in tl.static_range(8):
                # 2^23 + code as fp32 bits, minus 2^23: the code as a float without an int
                # conversion instruction.
                codes = (((words >> (4 * j)) & 0xF) | 0x4B000000).to(tl.float32, bitcast=True)
                codes = codes - 8388608.0
                x = tl.load(x_rows + j, mask=x_mask, other=0.0).to(tl.float32)
                products += codes[:, None, :] * x[None, :, :]
                x_sum += x
            dot = tl.sum(products, axis=2)
        group = k0 // group_size
        scale = tl.load(s_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
        zero = tl.load(z_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
        if ZERO_IS_MIN:
            acc += scale[:, None] * dot + zero[:, None] * tl.sum(x_sum, axis=1)[None, :]
        else:
            acc += scale[:, None] * (dot - zero[:, None] * tl.sum(x_sum, axis=1)[None, :])
    acc = tl.trans(acc)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        part = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + tl.program_id(1) * (M * N) + part, acc, mask=out_mask)
        is_last = split_k.arrive(counter_ptr, tl.program_id(0), offs_n, SPLIT_K)
        out_mask = out_mask & is_last[None, :]
        acc = split_k.sum_partials(part_ptr, part, out_mask, M * N, SPLIT_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip


def _small_batch_split(n: int, k: int, block_n: int, block_k: int, per_sm: int,
                       device: torch.device) -> int:  # fmt: skip
    """K splits so the launch has about per_sm programs per SM: one row's projection is a
    weight stream, and one program per column tile leaves too few loads in flight to reach
    HBM's bandwidth (split_k.py)."""
    tiles = triton.cdiv(n, block_n)
    want = triton.next_power_of_2(max(1, per_sm * num_sms(device) // tiles))
    return max(1, min(want, 16, k // block_k))


def int4_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32
    bias: torch.Tensor | None = None,  # [N]
    zero_is_min: bool = False,  # reference.dequantize_int4's
    mma_weight: torch.Tensor | None = None,  # int4_mma_layout.repack(qweight), where made
) -> torch.Tensor:  # [M, N] in x's dtype
    """The sm_90 Gluon kernel (int4_gemm_hopper) where the codes come re-laid for it and it
    applies(); this file's kernels otherwise."""
    m, k = x.shape
    n, groups = qweight.shape[0], scales.shape[1]
    group_size = k // groups
    if qweight.shape[1] * 8 != k or group_size * groups != k:
        raise ValueError(f"int4_linear: x [*, {k}] against codes {tuple(qweight.shape)} and "
                         f"{groups} groups")  # fmt: skip
    hopper = int4_gemm_hopper
    if mma_weight is not None and hopper is not None and hopper.applies(x, k, group_size):
        return hopper.int4_linear_mma(x, mma_weight, scales, zeros, bias, zero_is_min)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    # A K tile never straddles two groups; 16 is the smallest a dot takes.
    block_k = math.gcd(group_size, 64) if groups > 1 else 64
    if block_k < 16:
        raise ValueError(f"int4_linear: group size {group_size} is not a multiple of 16")
    bias_arg = bias if bias is not None else scales
    args = (x, qweight, scales, zeros, bias_arg, y, m, n, k, x.stride(0), y.stride(0), groups,
            group_size)  # fmt: skip
    if m <= SMALL_BATCH_ROWS:
        # Tiles from an H100 sweep over Llama-3.1-8B's projections (group 128): one row, 128
        # columns at 8 programs an SM (130 us a layer, 158 at 64 and 4); 2-8 rows, 64 at 4.
        block_k = math.gcd(group_size, 128) if groups > 1 else 128
        dot = m > 1 and block_k >= 128
        block_n, per_sm = (64, 4) if dot else (128, 8)
        split = _small_batch_split(n, k, block_n, block_k, per_sm, x.device)
        per_split, num_splits = split_k.k_per_split(k, split, block_k)
        part = counters = y
        if num_splits > 1:
            part = split_k.partials(num_splits, m, n, device=x.device)
            counters = split_k.counters(x.device)
        _int4_small_batch_kernel[(triton.cdiv(n, block_n), num_splits)](
            x, qweight, scales, zeros, bias_arg, y, part, counters, m, n, k, x.stride(0),
            y.stride(0), groups, group_size, per_split, HAS_BIAS=bias is not None,
            ROWS=16 if dot else triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=num_splits, DOT=dot, PRECISION=dot_precision(x.dtype),
            ZERO_IS_MIN=zero_is_min, num_warps=4, num_stages=3,
        )  # fmt: skip
        return y
    block_m = 16 if m <= 16 else 64
    block_n = 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        *args, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, ZERO_IS_MIN=zero_is_min,
    )  # fmt: skip
    return y
