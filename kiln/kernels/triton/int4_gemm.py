"""W4A16 GEMM (twin of reference.int4_linear): int4 codes packed 8 to an int32 along K
([N, K / 8], kiln.layers.quantization.int4's layout), dequantized in registers with their group's
scale and zero point, then multiplied in the activations' dtype (fp16 / bf16 tensor-core dots,
fp32 accumulation). The weight is read once per column tile, a quarter of bf16's bytes.

Two kernels: from 9 rows on, tiles of rows through tl.dot; 1-8 rows (decode), one program per
column tile over all rows with the products summed in registers (no 16-row dot tile padded with
empty rows). Neither is tuned on a GPU yet (tiles, split-K at small M, a Marlin-style layout
that loads words already in the dot's register order are left to do)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._device import dot_precision

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
def _int4_small_batch_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm,
                             stride_ym, groups, group_size, HAS_BIAS: tl.constexpr,
                             ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, ZERO_IS_MIN: tl.constexpr):  # fmt: skip
    offs_m = tl.arange(0, ROWS)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        w = _dequantized_tile(w_ptr, s_ptr, z_ptr, k0, offs_n, N, K, groups, group_size,
                              x.dtype, BLOCK_K, BLOCK_N, ZERO_IS_MIN)  # fmt: skip
        # Products rounded as a dot's inputs are (both in x's dtype), summed in fp32.
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])  # fmt: skip


def int4_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    qweight: torch.Tensor,  # [N, K / 8] int32
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32
    bias: torch.Tensor | None = None,  # [N]
    zero_is_min: bool = False,  # reference.dequantize_int4's
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n, groups = qweight.shape[0], scales.shape[1]
    group_size = k // groups
    if qweight.shape[1] * 8 != k or group_size * groups != k:
        raise ValueError(f"int4_linear: x [*, {k}] against codes {tuple(qweight.shape)} and "
                         f"{groups} groups")  # fmt: skip
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
        rows = triton.next_power_of_2(m)
        block_n = 32
        _int4_small_batch_kernel[(triton.cdiv(n, block_n),)](
            *args, HAS_BIAS=bias is not None, ROWS=rows, BLOCK_N=block_n,
            BLOCK_K=min(block_k, 32), ZERO_IS_MIN=zero_is_min,
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
