"""W8A16 GEMM (twin of reference.w8a16_linear): int8 or float8 e4m3 weights [N, K] with a scale
per output channel or per group of inputs (and optionally a min per group, added: GGUF's
blocks), widened and scaled in registers, then multiplied in
the activations' dtype (fp16 / bf16 tensor-core dots, fp32 accumulation): half bf16's weight
bytes, the activations' precision kept. int4_gemm.py's structure with one code a byte: tl.dot
tiles from 9 rows on, and for 1-8 rows (decode) one program per column tile over all rows with
the products summed in registers (no 16-row dot tile padded with empty rows). Not tuned on a GPU
yet (no split-K)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._device import dot_precision

SMALL_BATCH_ROWS = 8  # up to this many rows: _w8a16_small_batch_kernel


@triton.jit
def _x_and_widened_w(x_ptr, w_ptr, s_ptr, m_ptr, offs_m, offs_n, mask_m, mask_n, k0, K,
                     stride_xm, stride_wn, groups, group_size, HAS_MINS: tl.constexpr,
                     BLOCK_K: tl.constexpr):  # fmt: skip
    """One K tile: x's rows, and the weight codes widened and scaled to x's dtype."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask_k = offs_k < K
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
    mask_w = mask_k[:, None] & mask_n[None, :]
    # No `other`: one literal does not cast to both int8 and float8; zeroed after widening.
    codes = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None], mask=mask_w)
    # A K tile lies in one group (the launcher makes BLOCK_K divide the group size).
    scale = tl.load(s_ptr + offs_n * groups + k0 // group_size, mask=mask_n, other=0.0)
    w = codes.to(tl.float32) * scale[None, :]
    if HAS_MINS:  # code * scale is exact for GGUF's codes: fused or not, one rounding
        w += tl.load(m_ptr + offs_n * groups + k0 // group_size, mask=mask_n, other=0.0)[None, :]
    w = tl.where(mask_w, w, 0.0).to(x.dtype)
    return x, w


@triton.jit
def _w8a16_gemm_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn,
                       stride_ym, groups, group_size, HAS_MINS: tl.constexpr,
                       HAS_BIAS: tl.constexpr,
                       PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, w = _x_and_widened_w(x_ptr, w_ptr, s_ptr, m_ptr, offs_m, offs_n, mask_m, mask_n, k0,
                                K, stride_xm, stride_wn, groups, group_size, HAS_MINS,
                                BLOCK_K)  # fmt: skip
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


@triton.jit
def _w8a16_small_batch_kernel(x_ptr, w_ptr, s_ptr, m_ptr, b_ptr, y_ptr, M, N, K, stride_xm,
                              stride_wn, stride_ym, groups, group_size, HAS_MINS: tl.constexpr,
                              HAS_BIAS: tl.constexpr,
                              ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr):  # fmt: skip
    offs_m = tl.arange(0, ROWS)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((ROWS, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x, w = _x_and_widened_w(x_ptr, w_ptr, s_ptr, m_ptr, offs_m, offs_n, mask_m, mask_n, k0,
                                K, stride_xm, stride_wn, groups, group_size, HAS_MINS,
                                BLOCK_K)  # fmt: skip
        # Products rounded as a dot's inputs are (both in x's dtype), summed in fp32.
        acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def w8a16_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K] int8 or float8 e4m3
    scales: torch.Tensor,  # [N, groups] fp32
    bias: torch.Tensor | None = None,  # [N]
    mins: torch.Tensor | None = None,  # [N, groups] fp32: added to code * scale
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n, groups = weight.shape[0], scales.shape[1]
    group_size = k // groups
    if (weight.shape[1] != k or group_size * groups != k or scales.shape[0] != n
            or (mins is not None and mins.shape != scales.shape)):  # fmt: skip
        raise ValueError(f"w8a16_linear: x [*, {k}] against weight {tuple(weight.shape)} and "
                         f"scales {tuple(scales.shape)}")  # fmt: skip
    x, scales = x.contiguous(), scales.contiguous()
    has_mins = mins is not None
    mins = scales if mins is None else mins.contiguous()  # unread without HAS_MINS
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_k = math.gcd(group_size, 64) if groups > 1 else 64
    if block_k < 16:
        raise ValueError(f"w8a16_linear: group size {group_size} is not a multiple of 16")
    args = (x, weight, scales, mins, bias if bias is not None else scales, y, m, n, k,
            x.stride(0), weight.stride(0), y.stride(0), groups, group_size)  # fmt: skip
    if m <= SMALL_BATCH_ROWS:
        _w8a16_small_batch_kernel[(triton.cdiv(n, 32),)](
            *args, HAS_MINS=has_mins, HAS_BIAS=bias is not None, ROWS=triton.next_power_of_2(m),
            BLOCK_N=32, BLOCK_K=min(block_k, 32),
        )  # fmt: skip
        return y
    block_m = 16 if m <= 16 else 64
    block_n = 32 if m <= 16 else 64  # as int8_gemm's (unmeasured)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _w8a16_gemm_kernel[grid](
        *args, HAS_MINS=has_mins, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y
