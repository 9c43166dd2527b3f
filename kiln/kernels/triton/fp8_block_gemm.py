"""FP8 with 128x128 weight blocks, DeepSeek-V3's recipe (twins of reference.quantize_fp8_groups /
fp8_block_matmul / fp8_block_linear): activations quantized per token-group of 128 inputs at
run time, then a float8 tl.dot GEMM whose K tile is one block, each block's fp32 partial sum
scaled by its row's group scale and its columns' block scales before it joins the fp32
accumulator. The weight scales are per row of each K block ([N, K / 128]: the 128x128 block
scales repeated down their rows when loaded), so fused projections whose shards do not start
on a 128-row boundary (q/k/v) keep each shard's own blocks. Not tuned on a GPU yet."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_BLOCK, FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.kernels.triton.fp8_gemm import scaled_to_e4m3


@triton.jit
def _quantize_fp8_groups_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_out, K, groups,
                                FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                                GROUP: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(tl.max(tl.abs(x), 0), FP8_MAX), MIN_SCALE)
    tl.store(scale_ptr + row * groups + group, scale)
    q = scaled_to_e4m3(x, scale, tl.math.div_rn(1.0, scale), True, FP8_MAX, INTERPRETED)
    tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_groups(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] float8 e4m3, [M, ceil(K / 128)] fp32)
    """One program per (row, group); see reference.quantize_fp8_groups for the contract."""
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = triton.cdiv(k, FP8_BLOCK)
    out = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m > 0:
        _quantize_fp8_groups_kernel[(m, groups)](
            x, out, scales, x.stride(0), out.stride(0), k, groups, FP8_MAX=FP8_E4M3_MAX,
            MIN_SCALE=FP8_MIN_SCALE, GROUP=FP8_BLOCK, INTERPRETED=x.device.type != "cuda",
        )  # fmt: skip
    return out, scales


@triton.jit
def _fp8_block_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, groups,
                           stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        offs_k = g * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0.0)  # fmt: skip
        x_scale = tl.load(xs_ptr + offs_m * groups + g, mask=mask_m, other=0.0)
        w_scale = tl.load(ws_ptr + offs_n * groups + g, mask=mask_n, other=0.0)
        part = tl.dot(x, w, out_dtype=tl.float32)
        acc += part * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def fp8_block_matmul(
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3 (quantize_fp8_groups)
    x_scales: torch.Tensor,  # [M, ceil(K / 128)] fp32
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scales: torch.Tensor,  # [N, ceil(K / 128)] fp32: each row's scale of each K block
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    m, k = x_fp8.shape
    n, groups = weight.shape[0], triton.cdiv(k, FP8_BLOCK)
    if (
        weight.shape[1] != k
        or tuple(x_scales.shape) != (m, groups)
        or (tuple(weight_scales.shape) != (n, groups))
    ):
        raise ValueError(
            f"fp8_block_matmul: x [{m}, {k}] / {tuple(x_scales.shape)} against weight "
            f"{tuple(weight.shape)} / {tuple(weight_scales.shape)}"
        )
    x_fp8, x_scales, weight_scales = (t.contiguous() for t in (x_fp8, x_scales, weight_scales))
    y = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return y
    block_m = 16 if m <= 16 else (64 if m <= 256 else 128)
    block_n = 32 if m <= 16 else (64 if m <= 256 else 128)  # as int8_gemm's (unmeasured)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_block_gemm_kernel[grid](
        x_fp8, x_scales, weight, weight_scales, bias if bias is not None else weight_scales, y,
        m, n, k, groups, x_fp8.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK,
    )  # fmt: skip
    return y


def fp8_block_linear(
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scales: torch.Tensor,  # [N, ceil(K / 128)] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    x_fp8, x_scales = quantize_fp8_groups(x)
    return fp8_block_matmul(x_fp8, x_scales, weight, weight_scales, bias, x.dtype)
