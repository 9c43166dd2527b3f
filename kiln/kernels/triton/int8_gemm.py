"""W8A8 INT8 (twins of reference.quantize_int8 / int8_matmul / int8_linear): a per-token
quantizing kernel, then an int8 x int8 tl.dot GEMM accumulating in int32 on the tensor cores,
the row's and column's scales and the bias applied in its epilogue. In the model's blocks the
activations arrive quantized by the op before (add_rms_norm_quant_int8, silu_and_mul_quant_int8:
scaled_to_int8 below), as FP8's do, and only int8_matmul runs; int8_linear's own quantizing
kernel serves the projections after attention. From _CUBLAS_MIN_ROWS rows on a GPU the GEMM is
cuBLAS's int8 one (torch._int_mm, int32 out) with fp8_gemm's scale epilogue, as FP8's large
GEMMs are torch._scaled_mm. Neither path is measured or tuned on a GPU yet."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kiln.kernels.reference import FP8_MIN_SCALE, INT8_MAX
from kiln.kernels.triton.fp8_gemm import _scale_epilogue

_CUBLAS_MIN_ROWS = 64  # a guess: prefill and large decode batches to cuBLAS


@triton.jit
def round_half_even(v, INTERPRETED: tl.constexpr):
    """fp32 -> the nearest integer, ties to even, still fp32 (|v| < 2^22): rint on the GPU; the
    interpreter has no libdevice, so 1.5 * 2^23 is added and subtracted (exact in numpy's fp32)."""
    if INTERPRETED:  # noqa: SIM108 (a constexpr branch: the other is never compiled)
        r = (v + 12582912.0) - 12582912.0
    else:
        r = libdevice.rint(v)
    return r


@triton.jit
def scaled_to_int8(v, scale, INT_MAX: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 v / scale as reference.quantize_int8 rounds it: the IEEE quotient (div_rn, what
    torch divides by a tensor), rounded half to even, clamped to +-INT_MAX; still fp32."""
    q = round_half_even(tl.math.div_rn(v, scale), INTERPRETED)
    return tl.clamp(q, -INT_MAX, INT_MAX)


@triton.jit
def _quantize_int8_kernel(x_ptr, out_ptr, scale_ptr, stride_x, stride_out, K,
                          INT_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, BLOCK: tl.constexpr,
                          INTERPRETED: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    absmax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(absmax, 0), INT_MAX), MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = scaled_to_int8(x, scale, INT_MAX, INTERPRETED)
        tl.store(out_ptr + row * stride_out + cols, q.to(tl.int8), mask=mask)


def quantize_int8(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] int8, [M, 1] fp32)
    """One program per row; see reference.quantize_int8 for the contract."""
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    out = torch.empty((m, k), dtype=torch.int8, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m > 0:
        _quantize_int8_kernel[(m,)](
            x, out, scale, x.stride(0), out.stride(0), k, INT_MAX=float(INT8_MAX),
            MIN_SCALE=FP8_MIN_SCALE, BLOCK=min(triton.next_power_of_2(k), 2048),
            INTERPRETED=x.device.type != "cuda",
        )  # fmt: skip
    return out, scale


@triton.jit
def _int8_gemm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, b_ptr, y_ptr, M, N, K, stride_xm,
                      stride_wn, stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0)  # fmt: skip
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=mask_k[:, None] & mask_n[None, :], other=0)  # fmt: skip
        acc += tl.dot(x, w, out_dtype=tl.int32)
    x_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * x_scale[:, None] * w_scale[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             y.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])  # fmt: skip


def int8_matmul(
    x_int8: torch.Tensor,  # [M, K] int8
    x_scale: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    m, k = x_int8.shape
    n = weight.shape[0]
    if weight.shape[1] != k or x_scale.numel() != m or weight_scale.numel() != n:
        raise ValueError(f"int8_matmul: x [{m}, {k}] against weight {tuple(weight.shape)}")
    x_int8 = x_int8.contiguous()
    if x_int8.is_cuda and m >= _CUBLAS_MIN_ROWS and k % 8 == 0 and n % 8 == 0:
        return _cublas_int8_matmul(x_int8, x_scale, weight, weight_scale, bias, out_dtype)
    return _triton_int8_matmul(x_int8, x_scale, weight, weight_scale, bias, out_dtype, _tiles(m))


def _tiles(m: int) -> tuple[int, int, int]:
    """The Triton GEMM's (BLOCK_M, BLOCK_N, BLOCK_K) at m rows."""
    block_m = 16 if m <= 16 else (64 if m <= 256 else 128)
    # Decode rows: narrower column tiles, twice the programs over a weight read once (a guess,
    # not measured on a GPU yet).
    block_n = 32 if m <= 16 else (64 if m <= 256 else 128)
    return block_m, block_n, 64


def _cublas_int8_matmul(
    x_int8: torch.Tensor,  # [M, K] int8, contiguous
    x_scale: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    """int8_matmul's large-M path: cuBLAS's int32 sums, then fp8_gemm's scale epilogue."""
    acc = torch._int_mm(x_int8, weight.t())  # [M, N] int32; weight.t() is column-major
    return _scale_epilogue(acc, x_scale, weight_scale, bias, out_dtype)


def _triton_int8_matmul(
    x_int8: torch.Tensor,  # [M, K] int8, contiguous
    x_scale: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
    tiles: tuple[int, int, int],  # (BLOCK_M, BLOCK_N, BLOCK_K)
    **launch: int,
) -> torch.Tensor:  # [M, N] in out_dtype
    """The fused Triton GEMM at these tiles; launch takes Triton's num_warps and num_stages
    (its defaults where left out) so that benchmarks/kernels_gpu.py can time other configs."""
    m, k = x_int8.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x_int8.device)
    if m == 0:
        return y
    block_m, block_n, block_k = tiles
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int8_gemm_kernel[grid](
        x_int8, x_scale, weight, weight_scale, bias if bias is not None else weight_scale, y,
        m, n, k, x_int8.stride(0), weight.stride(0), y.stride(0), HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **launch,
    )  # fmt: skip
    return y


def int8_linear(
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    x_int8, x_scale = quantize_int8(x)
    return int8_matmul(x_int8, x_scale, weight, weight_scale, bias, x.dtype)
