"""Linear layers for a handful of rows, the norm before qkv and gate_up fused in, SiLU-mul after
gate_up (twins of reference.linear, reference.add_rms_norm_linear and
reference.add_rms_norm_linear_silu_mul).

At batch-1 decode a linear layer is a matrix-vector product bound by reading its weight once, and
the small kernels between them cost more than their bytes: on an H200 (Llama-3.1-8B, 1k context,
benchmarks/results/profile_decode_b1_h200.txt) each layer ran two RMSNorms (2.1 us each), a SiLU-mul
(1.5 us) and two cuBLAS split-K reduces (1.7 us each) around four GEMVs, ~9 us of a 148 us layer
plus the gaps between launches. Here each program owns BLOCK_N output columns for every row and
streams its [BLOCK_N, K] slice of the weight once (rows padded to tl.dot's minimum of 16; no
split-K, so no reduce kernel). For one row (batch-1 decode) the residual add and RMSNorm before
qkv_proj and gate_up_proj run inside the matmul's loop, on [BLOCK_K] vectors: h = x + residual
(the residual stream, written out in slices, one per program), times the norm weight; RMSNorm's
scale is one scalar per row, so the dot product is scaled by rsqrt(mean(h^2) + eps) at the end and
the weight's stream never waits for it. Each program reads the whole (tiny) input from L2.
For gate_up a program streams the gate rows of its output columns and the matching up rows, and
writes silu(gate) * up: the MLP's activation costs no kernel of its own.

More rows, and operands this kernel does not take, go through the unfused kernels and cuBLAS.
Rounding differs from the unfused path only inside the norm (h * weight is rounded to the model
dtype instead of normalised-then-rounded twice); fp32 agrees to ~1e-6.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.envs import envs
from kiln.kernels.triton._device import dot_precision, num_sms
from kiln.kernels.triton.rms_norm import fused_add_rms_norm, rms_norm
from kiln.kernels.triton.silu_mul import silu_and_mul

# Above this cuBLAS's GEMM tiles win, and the small kernels matter less.
# KILN_FUSED_LINEAR_MAX_ROWS=0 turns the fused kernels off (the benchmarks' A/B switch).
MAX_ROWS = envs().fused_linear_max_rows

_PLAIN, _NORM, _ADD_NORM = 0, 1, 2


@triton.jit
def _load_input_chunk(x_ptr, residual_ptr, norm_weight_ptr, offs, mask, PROLOGUE: tl.constexpr):
    """One K-chunk of the row's inputs: x, the residual (ADD_NORM; else x again, not loaded) and
    the norm weight."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if PROLOGUE == 2:  # noqa: SIM108 (a constexpr branch: no load otherwise)
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    else:
        residual = x
    norm_weight = tl.load(norm_weight_ptr + offs, mask=mask, other=0.0)
    return x, residual, norm_weight


@triton.jit
def _dot_step(a, w_rows, w_rows_hi, k_offsets, w_mask, acc, acc_hi, PAIRED: tl.constexpr,
              DOT_PRECISION: tl.constexpr):  # fmt: skip
    """One K-step: the weight tile of w_rows (and of w_rows_hi when PAIRED) times the inputs `a`,
    accumulated into acc (acc_hi)."""
    w = tl.load(w_rows + k_offsets[None, :], mask=w_mask, other=0.0)
    acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    if PAIRED:
        w_hi = tl.load(w_rows_hi + k_offsets[None, :], mask=w_mask, other=0.0)
        acc_hi = tl.dot(a, tl.trans(w_hi), acc_hi, input_precision=DOT_PRECISION)
    return acc, acc_hi


@triton.jit
def _project(
    x_ptr,  # [M, K]
    residual_ptr,  # [M, K], read when ADD_NORM
    norm_weight_ptr,  # [K], read when NORM or ADD_NORM
    w_ptr,  # the weight (its dtype is the dot's)
    w_rows,  # [BLOCK_N, 1] pointers: the weight rows of this program's columns
    w_rows_hi,  # [BLOCK_N, 1] pointers: a second set of rows, read when PAIRED
    col_mask,  # [BLOCK_N]
    sum_ptr,  # [M, K]: x + residual (its dtype rounds the residual stream)
    M,
    K,
    stride_xm,
    eps,
    PROLOGUE: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] fp32 dot products of the rows' (normed) inputs with w_rows, and with
    w_rows_hi when PAIRED (zeros otherwise); the weight is streamed once."""
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    row_mask = rows < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_hi = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if PROLOGUE == 0:
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        for k in range(0, K, BLOCK_K):
            k_mask = (k + ks) < K
            a = tl.load(
                x_rows + k + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            acc, acc_hi = _dot_step(
                a, w_rows, w_rows_hi, k + ks, col_mask[:, None] & k_mask[None, :], acc, acc_hi,
                PAIRED, DOT_PRECISION,
            )  # fmt: skip
    else:
        # One row (M == 1). The residual add and the norm run on [BLOCK_K] vectors (padding
        # them to the dot's 16 rows would compute, and hold in registers, 16 times as much: that
        # version ran 3-5x slower than unfused on the H200), and the result goes into row 0 of
        # the dot's tile. The next chunk's inputs are loaded one iteration ahead by hand: they
        # feed arithmetic, not the dot, so the pipeliner leaves their latency exposed otherwise.
        first_row = rows[:, None] == 0
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        xa, xb, nw = _load_input_chunk(x_ptr, residual_ptr, norm_weight_ptr, ks, ks < K, PROLOGUE)
        for k in range(0, K, BLOCK_K):
            k_mask = (k + ks) < K
            nxt = k + BLOCK_K + ks
            xa_next, xb_next, nw_next = _load_input_chunk(
                x_ptr, residual_ptr, norm_weight_ptr, nxt, nxt < K, PROLOGUE
            )
            h = xa
            if PROLOGUE == 2:  # the residual stream rounds to its dtype, as unfused
                h = (xa.to(tl.float32) + xb.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            h32 = h.to(tl.float32)
            sum_sq += h32 * h32
            v = (h32 * nw.to(tl.float32)).to(w_ptr.dtype.element_ty)
            a = tl.where(first_row, v[None, :], 0.0).to(w_ptr.dtype.element_ty)
            acc, acc_hi = _dot_step(
                a, w_rows, w_rows_hi, k + ks, col_mask[:, None] & k_mask[None, :], acc, acc_hi,
                PAIRED, DOT_PRECISION,
            )  # fmt: skip
            xa, xb, nw = xa_next, xb_next, nw_next
        # RMSNorm's scale is one scalar per row: applied to the dot product instead.
        inv_rms = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        acc = acc * inv_rms
        acc_hi = acc_hi * inv_rms
    return acc, acc_hi


@triton.jit
def _write_residual_sum(x_ptr, residual_ptr, sum_ptr, K, BLOCK_K: tl.constexpr):
    """x + residual (one row) into sum_ptr, written out in slices: each program its own."""
    pid = tl.program_id(0)
    ks = tl.arange(0, BLOCK_K)
    per = tl.cdiv(K, tl.num_programs(0))
    for k in range(pid * per, (pid + 1) * per, BLOCK_K):
        offs = k + ks
        mask = (offs < K) & (offs < (pid + 1) * per)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + offs, (x + r).to(sum_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _small_batch_linear_kernel(
    x_ptr,  # [M, K]
    residual_ptr,  # [M, K], read when ADD_NORM
    norm_weight_ptr,  # [K], read when NORM or ADD_NORM
    w_ptr,  # [N, K], contiguous
    bias_ptr,  # [N], read when HAS_BIAS
    out_ptr,  # [M, N]: x @ w.T, or with GATED silu(x @ w[:N].T) * (x @ w[N:].T)
    sum_ptr,  # [M, K]: x + residual, written when ADD_NORM
    M,
    N,
    K,
    stride_xm,
    stride_om,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # w is [2N, K] = [gate; up]: each program streams both halves' rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * K
    up_rows = w_rows + N.to(tl.int64) * K  # GATED: the up projection's rows for these columns
    acc, acc_up = _project(
        x_ptr, residual_ptr, norm_weight_ptr, w_ptr, w_rows, up_rows, col_mask, sum_ptr, M, K,
        stride_xm, eps, PROLOGUE, GATED, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION,
    )  # fmt: skip
    if PROLOGUE == 2:
        _write_residual_sum(x_ptr, residual_ptr, sum_ptr, K, BLOCK_K)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GATED:
        # silu(gate) * up rounded as reference.silu_and_mul over the unfused projection's
        # output: gate and up to the model dtype, silu in fp32 to the dtype, the product again.
        dtype = out_ptr.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])


def _tile_config(
    n: int, k: int, device: torch.device, element_size: int = 2, fused_norm: bool = False
) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for n weight rows (a gated kernel's program
    streams BLOCK_N // 2 rows of each half)."""
    if device.type != "cuda":
        return 16, 32, 4, 1  # the interpreter: small tiles, every masking path exercised
    # As many columns per program as still leave about one program per SM. H200 sweeps at
    # Llama-3.1-8B shapes (benchmarks/results/fused_linear/run2): plain, 32 KiB weight tiles in 4
    # stages (o_proj, down: 32 x 512); with the norm fused, 3 stages, and 128-wide K steps when
    # the programs outnumber the SMs (qkv 64 x 256: 17.2 us; gate_up 64 x 128: 57.5 us).
    sms = num_sms(device)
    block_n = 64 if triton.cdiv(n, 64) >= 0.7 * sms else 32
    block_k = 32768 // (block_n * element_size)
    if not fused_norm:
        return block_n, block_k, 4, 4 if triton.cdiv(n, block_n) <= sms else 3
    if triton.cdiv(n, block_n) > sms:
        block_k //= 2
    return block_n, block_k, 4, 3


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _fits(x: torch.Tensor, weight: torch.Tensor, k: int, one_row: bool = False) -> bool:
    """Whether the kernel takes these operands (else the unfused path runs). The fused ops
    before the matmul take one row (batch-1 decode); the plain linear up to MAX_ROWS."""
    return (
        0 < _rows(x) <= (min(1, MAX_ROWS) if one_row else MAX_ROWS)
        and weight.is_contiguous()
        and weight.shape[1] == k
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


def _launch(
    prologue: int,
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    summed: torch.Tensor | None = None,
    gated: bool = False,
) -> torch.Tensor:
    m = x2.shape[0]
    rows, k = weight.shape
    n = rows // 2 if gated else rows
    out = torch.empty((m, n), dtype=x2.dtype, device=x2.device)
    block_n, block_k, num_warps, num_stages = _tile_config(
        rows, k, x2.device, x2.element_size(), fused_norm=prologue != _PLAIN
    )
    if gated and x2.device.type == "cuda":
        block_n //= 2  # the same bytes per step: BLOCK_N / 2 rows of gate and of up
    _small_batch_linear_kernel[(triton.cdiv(n, block_n),)](
        x2,
        residual if residual is not None else x2,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        out,
        summed if summed is not None else out,
        m,
        n,
        k,
        x2.stride(0),
        out.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        GATED=gated,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_PRECISION=dot_precision(x2.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def _rows_2d(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [..., N]
    """F.linear; a handful of rows take one kernel without a split-K reduce."""
    if not _fits(x, weight, x.shape[-1]):
        return F.linear(x, weight, bias)
    out = _launch(_PLAIN, _rows_2d(x), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def _fused_norm_fits(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, weight: torch.Tensor
) -> bool:
    return (
        _fits(x, weight, x.shape[-1], one_row=True)
        and norm_weight.dtype == x.dtype
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
    )


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) as kernels of their own: the unfused path."""
    if residual is None:
        return rms_norm(x, norm_weight, eps), x
    return fused_add_rms_norm(x, residual, norm_weight, eps)


def _launch_norm_fused(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows_2d(x)
    if residual is None:
        out = _launch(_NORM, x2, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated)
        return out, x
    # A new tensor, never x or residual: every program reads all of those while the others
    # write their slices of the sum.
    summed = torch.empty_like(x2)
    out = _launch(
        _ADD_NORM, x2, weight, bias, _rows_2d(residual), norm_weight, eps, summed, gated=gated
    )
    return out, summed.view(x.shape)


def add_rms_norm_linear(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual); with no residual,
    (linear(rms_norm(x)), x)."""
    if not _fused_norm_fits(x, residual, norm_weight, weight):
        normed, summed = _add_rms_norm(x, residual, norm_weight, eps)
        return F.linear(normed, weight, bias), summed
    out, summed = _launch_norm_fused(x, residual, norm_weight, eps, weight, bias, gated=False)
    return out.view(*x.shape[:-1], weight.shape[0]), summed


def add_rms_norm_linear_silu_mul(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2N, K]: the gate projection's rows, then the up projection's
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, N], [num_tokens, K])
    """(silu_and_mul(add_rms_norm_linear(...)), x + residual): the Llama MLP up to its down
    projection. One kernel for one row: each program streams the gate rows of its output columns
    and the matching up rows, so SiLU-mul runs on its accumulators (at batch 1 its own kernel
    was 1.5 us plus a launch gap per layer); the plain gated kernel up to MAX_ROWS after the norm
    kernel; above that cuBLAS and the SiLU kernel."""
    if _fused_norm_fits(x, residual, norm_weight, weight):
        out, summed = _launch_norm_fused(x, residual, norm_weight, eps, weight, None, gated=True)
        return out.view(*x.shape[:-1], weight.shape[0] // 2), summed
    normed, summed = _add_rms_norm(x, residual, norm_weight, eps)
    if not _fits(normed, weight, normed.shape[-1]):
        return silu_and_mul(F.linear(normed, weight)), summed
    out = _launch(_PLAIN, _rows_2d(normed), weight, None, gated=True)
    return out.view(*x.shape[:-1], weight.shape[0] // 2), summed
