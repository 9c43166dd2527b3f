"""Linear layers for a handful of rows (twin of reference.linear): batch-1 to batch-8 decode.

At a few rows a linear layer is a matrix-vector product bound by reading the weight once. cuBLAS
picks general GEMM tiles there and, for the smaller Llama-3.1-8B projections, reaches only 63-73%
of the copy bandwidth on an H200 (qkv 16.3 us, o_proj 10.9 us + a split-K reduce: see
benchmarks/results/profile_decode_b1_h200.txt). Here each program owns BLOCK_N output columns for
every row and streams its [BLOCK_N, K] slice of the weight once, with the rows padded to tl.dot's
minimum of 16. Bigger batches, and shapes this kernel does not tile, stay on cuBLAS.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.triton._device import dot_precision

MAX_ROWS = 8  # above this, cuBLAS's GEMM tiles win (and the padded rows here cost more)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,  # [M, K]
    w_ptr,  # [N, K], contiguous
    bias_ptr,  # [N] or a dummy when not HAS_BIAS
    out_ptr,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    col_mask = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    for k in range(0, K, BLOCK_K):
        k_mask = (k + ks) < K
        x = tl.load(x_rows + k + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_rows + k + ks[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _config(n: int, k: int, device: torch.device) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if device.type != "cuda":
        return 16, 32, 4, 1  # the interpreter: small tiles, every masking path exercised
    return 16, 256, 4, 4


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x @ weight.T + bias for x of at most MAX_ROWS rows (any leading shape)."""
    *lead, k = x.shape
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert m <= MAX_ROWS and weight.shape[1] == k and weight.is_contiguous()
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, n)
    bn, bk, warps, stages = _config(n, k, x.device)
    bn, bk = block_n or bn, block_k or bk
    _skinny_gemm_kernel[(triton.cdiv(n, bn),)](
        x2,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        n,
        k,
        x2.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        BLOCK_M=16,
        BLOCK_N=bn,
        BLOCK_K=bk,
        DOT_PRECISION=dot_precision(x.dtype),
        num_warps=num_warps or warps,
        num_stages=num_stages or stages,
    )
    return out.reshape(*lead, n)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through skinny_linear when x has at most MAX_ROWS rows."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if 0 < rows <= MAX_ROWS and weight.is_contiguous():
        return skinny_linear(x, weight, bias)
    return F.linear(x, weight, bias)
