"""Linear layers for a handful of rows, the norm before qkv and gate_up fused in, SiLU-mul after
gate_up (twins of reference.linear, reference.add_rms_norm_linear and
reference.add_rms_norm_linear_silu_mul).

At batch-1 decode a linear layer is a matrix-vector product bound by reading its weight once, and
the small kernels between them cost more than their bytes: on an H200 (Llama-3.1-8B, 1k context)
each layer ran two RMSNorms (2.1 us each), a SiLU-mul (1.5 us) and two cuBLAS split-K reduces (1.7
us each) around four GEMVs, ~9 us of a 148 us layer plus the gaps between launches. Here each
program owns BLOCK_N output columns for every row and streams its [BLOCK_N, K] slice of the weight
once (rows padded to tl.dot's minimum of 16; a float8 tile of 64 rows or more is the dot's first
operand, a wgmma from shared memory: _times). A launch may instead cut K over several programs per
tile, their partial sums reduced inside the same kernel (split_k.py; which launches, and their
tiles: small_batch_tiles.py). For one row (batch-1 decode) the residual add and RMSNorm before
qkv_proj and gate_up_proj run inside the matmul's loop, on [BLOCK_K] vectors: h = x + residual (the
residual stream, written out in slices, one per program), times the norm weight; RMSNorm's scale is
one scalar per row, so the dot product is scaled by rsqrt(mean(h^2) + eps) at the end and the
weight's stream never waits for it (in bf16; float8 needs the scale, and the absmax, before
quantizing: a first pass over the row finds them). Each program reads the whole (tiny) input from
L2.
For gate_up a program streams the gate rows of its output columns and the matching up rows, and
writes silu(gate) * up: the MLP's activation costs no kernel of its own (GeGLU's gelu-tanh with
ACTIVATION). X_NORM: x is a block's output that joins the stream RMS-normed by its own weight
(Gemma 2/3's sandwich norms), normalised on the fly with a first pass for its scale, so that
norm too costs no launch. Both are constexprs a launch passes only when set.

More rows, and operands this kernel does not take, go through the unfused kernels and cuBLAS.
Rounding differs from the unfused path only inside the norm (h * weight is rounded to the model
dtype instead of normalised-then-rounded twice); fp32 agrees to ~1e-6.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.triton import fp8_gemm, small_batch_tiles, split_k
from kiln.kernels.triton._device import dot_precision
from kiln.kernels.triton.fp8_gemm import scaled_to_e4m3
from kiln.kernels.triton.rms_norm import (
    add_rms_norm_quant_fp8,
    fused_add_rms_norm,
    lone_x_norm,
    rms_norm,
)
from kiln.kernels.triton.silu_mul import (
    _gelu_tanh_f32,
    gelu_tanh_and_mul,
    gelu_tanh_and_mul_quant_fp8,
    silu_and_mul,
    silu_and_mul_quant_fp8,
)

# Most rows the small-batch kernels take: above it cuBLAS's GEMM tiles win, and the small kernels
# matter less.
MAX_ROWS = 8

_PLAIN, _NORM, _ADD_NORM = 0, 1, 2
# The gated kernels' ACTIVATION by a gated MLP's activation name (0, SiLU, the default).
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}


def _act_and_mul(activation: str, quant: bool = False) -> Callable[..., Any]:
    """The unfused activation-mul kernel (quant: its float8-writing form) for an activation
    name, looked up at the call (so a test's patch of this module's names reaches it)."""
    if ACTIVATIONS[activation] == 0:
        return silu_and_mul_quant_fp8 if quant else silu_and_mul
    return gelu_tanh_and_mul_quant_fp8 if quant else gelu_tanh_and_mul


@triton.jit
def _load_input_chunk(x_ptr, residual_ptr, norm_weight_ptr, offs, mask, PROLOGUE: tl.constexpr,
                      x_norm_weight_ptr=None, inv_rms_x=0.0,
                      X_NORM: tl.constexpr = False):  # fmt: skip
    """One K-chunk of the row's inputs: x, the residual (ADD_NORM; else x again, not loaded) and
    the norm weight. X_NORM: x comes normed (_x_normed) by its weight and the row's inv_rms_x."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if X_NORM:
        x = _x_normed(x, tl.load(x_norm_weight_ptr + offs, mask=mask, other=0.0), inv_rms_x)
    if PROLOGUE == 2:  # noqa: SIM108 (a constexpr branch: no load otherwise)
        residual = tl.load(residual_ptr + offs, mask=mask, other=0.0)
    else:
        residual = x
    norm_weight = tl.load(norm_weight_ptr + offs, mask=mask, other=0.0)
    return x, residual, norm_weight


@triton.jit
def _x_normed(x, x_weight, inv_rms_x):
    """reference.sandwich_input's chunk: x normalised in fp32, rounded to its dtype, times the
    weight rounded again (rms_norm's rounding)."""
    normed = (x.to(tl.float32) * inv_rms_x).to(x.dtype).to(tl.float32)
    return (normed * x_weight.to(tl.float32)).to(x.dtype)


@triton.jit
def _x_inv_rms(x_ptr, K, eps, STATS_BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of one row (an X_NORM launch's first pass, from L2)."""
    ks = tl.arange(0, STATS_BLOCK)
    sum_sq = tl.zeros([STATS_BLOCK], dtype=tl.float32)
    for k in range(0, K, STATS_BLOCK):
        v = tl.load(x_ptr + k + ks, mask=(k + ks) < K, other=0.0).to(tl.float32)
        sum_sq += v * v
    return tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)


@triton.jit
def _times(a, w, acc, DOT_PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + a @ w.T ([BLOCK_M, BLOCK_N]), or with SWAP_AB its transpose acc + w @ a.T
    ([BLOCK_N, BLOCK_M]): the weight tile as the dot's first operand, which on Hopper makes it
    a float8 wgmma reading the tile straight from shared memory (64 weight rows are its M, the
    16 padded input rows its N) instead of an HMMA fed by the tile widened to fp16 in registers
    (sm_90 SASS of the one-row loop: no F2FP, LDSM or HMMA left, 8 QGMMA a trip). Batch-1
    decode +3.3% on an H100, +1.7% on an H200."""
    if SWAP_AB:  # a constexpr branch: one result type per compiled variant
        acc = tl.dot(w, tl.trans(a), acc, input_precision=DOT_PRECISION)
    else:
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _zeros(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """An accumulator for _times: [BLOCK_M, BLOCK_N], transposed with SWAP_AB."""
    if SWAP_AB:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    return acc


@triton.jit
def _rows_first(acc, acc_hi, SWAP_AB: tl.constexpr):
    """The accumulators as [BLOCK_M, BLOCK_N] again after the loop (once, not per step)."""
    if SWAP_AB:
        acc = tl.trans(acc)
        acc_hi = tl.trans(acc_hi)
    return acc, acc_hi


@triton.jit
def _dot_step(a, w_rows, w_rows_hi, k_offsets, w_mask, acc, acc_hi, PAIRED: tl.constexpr,
              DOT_PRECISION: tl.constexpr, WIDEN: tl.constexpr,
              SWAP_AB: tl.constexpr = False):  # fmt: skip
    """One K-step: the weight tile of w_rows (and of w_rows_hi when PAIRED) times the inputs `a`,
    accumulated into acc (acc_hi; transposed with SWAP_AB, see _times). WIDEN: float8 weights go
    to fp16 (exact) for an fp16 dot."""
    w = tl.load(w_rows + k_offsets[None, :], mask=w_mask, other=0.0)
    if WIDEN:
        w = w.to(tl.float16)
    acc = _times(a, w, acc, DOT_PRECISION, SWAP_AB)
    if PAIRED:
        w_hi = tl.load(w_rows_hi + k_offsets[None, :], mask=w_mask, other=0.0)
        if WIDEN:
            w_hi = w_hi.to(tl.float16)
        acc_hi = _times(a, w_hi, acc_hi, DOT_PRECISION, SWAP_AB)
    return acc, acc_hi


@triton.jit
def _quantize(v, scale, inv_scale, DYNAMIC: tl.constexpr, FP8_DOT: tl.constexpr,
              FP8_MAX: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """fp32 activations as the float8 dot operand: the IEEE quotient v / scale from the scale's
    reciprocal (inv_scale, div_rn once a row: fp8_gemm.scaled_to_e4m3, as
    reference.quantize_fp8, so the float8 bits equal the reference's), saturated at +-448,
    rounded to e4m3; widened to fp16 (exact) unless the dot takes float8 itself."""
    q = scaled_to_e4m3(v, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED)
    q = q.to(tl.float8e4nv)
    if not FP8_DOT:
        q = q.to(tl.float16)
    return q


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
    in_scale_ptr,  # [] fp32: the static activation scale, read when QUANT == STATIC
    M,
    K,
    k_start,  # the weight stream's K range: all of K, or a split-K program's slice (whole
    k_stop,  # BLOCK_K steps from k_start); the passes over the input row always read all of K
    stride_xm,
    eps,
    PROLOGUE: tl.constexpr,
    PAIRED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr,  # K per step of those passes over the input row
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr = 0,  # 0: weights in the model dtype. Float8 weights (W8A8, scaled by
    # the activation scale here and by the caller's per-column weight scales) with activations
    # quantized here per row (1, dynamic) or by in_scale (2, static), or given in float8 with a
    # scale per row (3) or one static scale (4) at in_scale_ptr
    FP8_DOT: tl.constexpr = False,  # float8 x float8 dots (the interpreter: both widened to fp16)
    INTERPRETED: tl.constexpr = False,  # the Triton interpreter (see fp8_gemm.round_to_e4m3_grid)
    FP8_MAX: tl.constexpr = 448.0,
    MIN_SCALE: tl.constexpr = 1e-12,
    SWAP_AB: tl.constexpr = False,  # float8 weights: the weight tile as the dot's first operand
    x_norm_weight_ptr=None,  # [K], read when X_NORM
    inv_rms_x=0.0,  # X_NORM: the row's _x_inv_rms
    X_NORM: tl.constexpr = False,  # ADD_NORM with x normed first (reference.sandwich_input)
):
    """[BLOCK_M, BLOCK_N] fp32 dot products of the rows' (normed) inputs with w_rows, and with
    w_rows_hi when PAIRED (zeros otherwise), over K in [k_start, k_stop); the weight is streamed
    once. With QUANT, the activations are quantized to float8 as reference.quantize_fp8 does: a
    dynamic scale needs the row's absmax first, so a first pass over the (small, L2-resident)
    input row finds it. The one-row bf16 path with the norm fused takes all of K (its norm scale
    is summed along the stream)."""
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    stats_ks = tl.arange(0, STATS_BLOCK)
    row_mask = rows < M
    widen: tl.constexpr = QUANT != 0 and not FP8_DOT
    tl.static_assert(not SWAP_AB or QUANT != 0, "SWAP_AB: float8 weights only")
    tl.static_assert(not X_NORM or PROLOGUE == 2, "an x-norm comes before a residual add")
    acc = _zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_hi = _zeros(BLOCK_M, BLOCK_N, SWAP_AB)
    if PROLOGUE == 0 and (QUANT == 1 or QUANT == 2):
        # One row quantized here (batch-1 decode: no kernel of its own for it). The row is a
        # [BLOCK_K] vector, put into row 0 of the dot's tile: quantizing a [BLOCK_M, BLOCK_K]
        # tile would do the arithmetic (a quotient per value) for 16 rows.
        first_row = rows[:, None] == 0
        if QUANT == 1:
            absmax = tl.zeros([STATS_BLOCK], dtype=tl.float32)
            for k in range(0, K, STATS_BLOCK):
                v = tl.load(x_ptr + k + stats_ks, mask=(k + stats_ks) < K, other=0.0)
                absmax = tl.maximum(absmax, tl.abs(v.to(tl.float32)))
            scale = tl.maximum(tl.math.div_rn(tl.max(absmax, 0), FP8_MAX), MIN_SCALE)
        else:
            scale = tl.load(in_scale_ptr)
        inv_scale = tl.math.div_rn(1.0, scale)  # once: each value is multiplied by it
        for k in range(k_start, k_stop, BLOCK_K):
            k_mask = (k + ks) < K
            v = tl.load(x_ptr + k + ks, mask=k_mask, other=0.0).to(tl.float32)
            q = _quantize(v, scale, inv_scale, QUANT == 1, FP8_DOT, FP8_MAX, INTERPRETED)
            a = tl.where(first_row, q[None, :], 0.0).to(q.dtype)
            acc, acc_hi = _dot_step(
                a, w_rows, w_rows_hi, k + ks, col_mask[:, None] & k_mask[None, :], acc, acc_hi,
                PAIRED, DOT_PRECISION, widen, SWAP_AB,
            )  # fmt: skip
        acc, acc_hi = _rows_first(acc, acc_hi, SWAP_AB)
        acc = acc * scale
        acc_hi = acc_hi * scale
    elif PROLOGUE == 0:
        # Inputs in the dot's dtype: the model's, or float8 already quantized (QUANT 3: a scale
        # per row at in_scale_ptr; 4: one static scale).
        x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        for k in range(k_start, k_stop, BLOCK_K):
            k_mask = (k + ks) < K
            a = tl.load(
                x_rows + k + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
            )
            if widen:
                a = a.to(tl.float16)
            acc, acc_hi = _dot_step(
                a, w_rows, w_rows_hi, k + ks, col_mask[:, None] & k_mask[None, :], acc, acc_hi,
                PAIRED, DOT_PRECISION, widen, SWAP_AB,
            )  # fmt: skip
        acc, acc_hi = _rows_first(acc, acc_hi, SWAP_AB)
        if QUANT == 3:
            row_scale = tl.load(in_scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
            acc = acc * row_scale
            acc_hi = acc_hi * row_scale
        elif QUANT == 4:
            acc = acc * tl.load(in_scale_ptr)
            acc_hi = acc_hi * tl.load(in_scale_ptr)
    elif QUANT != 0:
        # One row, float8: a first pass for RMSNorm's scale (and the absmax of the normed row,
        # for a dynamic scale), then each chunk normalised as reference.rms_norm rounds it
        # (fp32, to the model dtype, times the norm weight in the model dtype), quantized, and
        # multiplied into the weight's stream.
        first_row = rows[:, None] == 0
        dtype = sum_ptr.dtype.element_ty
        sum_sq = tl.zeros([STATS_BLOCK], dtype=tl.float32)
        # Per lane, the element of largest |h * norm weight| and its factors: the normed row's
        # absmax needs RMSNorm's scale, known only after this pass, so the candidates are
        # normalised (and rounded as the reference rounds them) after it.
        best = tl.full([STATS_BLOCK], -1.0, dtype=tl.float32)
        best_h = tl.zeros([STATS_BLOCK], dtype=tl.float32)
        best_nw = tl.zeros([STATS_BLOCK], dtype=tl.float32)
        for k in range(0, K, STATS_BLOCK):
            xa, xb, nw = _load_input_chunk(
                x_ptr, residual_ptr, norm_weight_ptr, k + stats_ks, (k + stats_ks) < K, PROLOGUE,
                x_norm_weight_ptr, inv_rms_x, X_NORM,
            )  # fmt: skip
            h32 = xa.to(tl.float32)
            if PROLOGUE == 2:
                h32 = (xa.to(tl.float32) + xb.to(tl.float32)).to(dtype).to(tl.float32)
            sum_sq += h32 * h32
            if QUANT == 1:
                nw32 = nw.to(tl.float32)
                hw = tl.abs(h32 * nw32)
                larger = hw > best
                best = tl.where(larger, hw, best)
                best_h = tl.where(larger, h32, best_h)
                best_nw = tl.where(larger, nw32, best_nw)
        inv_rms = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        if QUANT == 1:
            # The normed row's absmax as reference.rms_norm rounds it (the element of largest
            # |h * w| is the largest normed value up to that rounding: ties are what can differ).
            candidates = ((best_h * inv_rms).to(dtype) * best_nw.to(dtype)).to(tl.float32)
            absmax = tl.max(tl.abs(candidates), 0)
            scale = tl.maximum(tl.math.div_rn(absmax, FP8_MAX), MIN_SCALE)
        else:
            scale = tl.load(in_scale_ptr)
        inv_scale = tl.math.div_rn(1.0, scale)
        for k in range(k_start, k_stop, BLOCK_K):
            k_mask = (k + ks) < K
            xa, xb, nw = _load_input_chunk(
                x_ptr, residual_ptr, norm_weight_ptr, k + ks, k_mask, PROLOGUE,
                x_norm_weight_ptr, inv_rms_x, X_NORM,
            )  # fmt: skip
            h32 = xa.to(tl.float32)
            if PROLOGUE == 2:
                h32 = (xa.to(tl.float32) + xb.to(tl.float32)).to(dtype).to(tl.float32)
            normed = ((h32 * inv_rms).to(dtype) * nw.to(dtype)).to(tl.float32)
            q = _quantize(normed, scale, inv_scale, QUANT == 1, FP8_DOT, FP8_MAX, INTERPRETED)
            a = tl.where(first_row, q[None, :], 0.0).to(q.dtype)
            acc, acc_hi = _dot_step(
                a, w_rows, w_rows_hi, k + ks, col_mask[:, None] & k_mask[None, :], acc, acc_hi,
                PAIRED, DOT_PRECISION, widen, SWAP_AB,
            )  # fmt: skip
        acc, acc_hi = _rows_first(acc, acc_hi, SWAP_AB)
        acc = acc * scale
        acc_hi = acc_hi * scale
    else:
        # One row (M == 1). The residual add and the norm run on [BLOCK_K] vectors (padding
        # them to the dot's 16 rows would compute, and hold in registers, 16 times as much: that
        # version ran 3-5x slower than unfused on the H200), and the result goes into row 0 of
        # the dot's tile. The next chunk's inputs are loaded one iteration ahead by hand: they
        # feed arithmetic, not the dot, so the pipeliner leaves their latency exposed otherwise.
        first_row = rows[:, None] == 0
        sum_sq = tl.zeros([BLOCK_K], dtype=tl.float32)
        xa, xb, nw = _load_input_chunk(
            x_ptr, residual_ptr, norm_weight_ptr, ks, ks < K, PROLOGUE, x_norm_weight_ptr,
            inv_rms_x, X_NORM,
        )  # fmt: skip
        for k in range(0, K, BLOCK_K):
            k_mask = (k + ks) < K
            nxt = k + BLOCK_K + ks
            xa_next, xb_next, nw_next = _load_input_chunk(
                x_ptr, residual_ptr, norm_weight_ptr, nxt, nxt < K, PROLOGUE, x_norm_weight_ptr,
                inv_rms_x, X_NORM,
            )  # fmt: skip
            h = xa
            if PROLOGUE == 2:  # the residual stream rounds to its dtype, as unfused
                h = (xa.to(tl.float32) + xb.to(tl.float32)).to(sum_ptr.dtype.element_ty)
            h32 = h.to(tl.float32)
            sum_sq += h32 * h32
            v = (h32 * nw.to(tl.float32)).to(w_ptr.dtype.element_ty)
            a = tl.where(first_row, v[None, :], 0.0).to(w_ptr.dtype.element_ty)
            acc, acc_hi = _dot_step(
                a, w_rows, w_rows_hi, k + ks, col_mask[:, None] & k_mask[None, :], acc, acc_hi,
                PAIRED, DOT_PRECISION, False,
            )  # fmt: skip
            xa, xb, nw = xa_next, xb_next, nw_next
        # RMSNorm's scale is one scalar per row: applied to the dot product instead.
        inv_rms = tl.rsqrt(tl.sum(sum_sq, 0) / K + eps)
        acc = acc * inv_rms
        acc_hi = acc_hi * inv_rms
    return acc, acc_hi


@triton.jit
def _write_residual_sum(x_ptr, residual_ptr, sum_ptr, K, BLOCK_K: tl.constexpr,
                        x_norm_weight_ptr=None, inv_rms_x=0.0,
                        X_NORM: tl.constexpr = False):  # fmt: skip
    """x + residual (one row) into sum_ptr, written out in slices: each program (over the
    tiles and their splits) its own. X_NORM: x normed first (_x_normed)."""
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    ks = tl.arange(0, BLOCK_K)
    per = tl.cdiv(K, tl.num_programs(0) * tl.num_programs(1))
    for k in range(pid * per, (pid + 1) * per, BLOCK_K):
        offs = k + ks
        mask = (offs < K) & (offs < (pid + 1) * per)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0)
        if X_NORM:
            xw = tl.load(x_norm_weight_ptr + offs, mask=mask, other=0.0)
            x = _x_normed(x, xw, inv_rms_x)
        x = x.to(tl.float32)
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(sum_ptr + offs, (x + r).to(sum_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _small_batch_linear_kernel(
    x_ptr,  # [M, K]
    residual_ptr,  # [M, K], read when ADD_NORM
    norm_weight_ptr,  # [K], read when NORM or ADD_NORM
    w_ptr,  # [N, K], rows stride_wn apart (K, or more: outlier columns' aligned rows)
    bias_ptr,  # [N], read when HAS_BIAS
    out_ptr,  # [M, N]: x @ w.T, or with GATED silu(x @ w[:N].T) * (x @ w[N:].T)
    sum_ptr,  # [M, K]: x + residual, written when ADD_NORM
    w_scale_ptr,  # [N] (GATED: [2N]) fp32 per-row weight scales, read when QUANT
    in_scale_ptr,  # [] fp32 static activation scale, read when QUANT == 2
    part_ptr,  # [SPLIT_K, 1 + GATED, M, N] fp32 partial sums, when SPLIT_K > 1
    counter_ptr,  # [number of column tiles] int32 zeros (split_k.counters), when SPLIT_K > 1
    M,
    N,
    K,
    k_per_split,  # K when SPLIT_K is 1
    stride_xm,
    stride_om,
    stride_wn,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GATED: tl.constexpr,  # w is [2N, K] = [gate; up]: each program streams both halves' rows
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    SPLIT_K: tl.constexpr,  # programs per column tile, program_id(1) the split (split_k.py)
    DOT_PRECISION: tl.constexpr,
    QUANT: tl.constexpr,  # 0, or float8 weights: see _project
    FP8_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    SWAP_AB: tl.constexpr,  # see _times
    x_norm_weight_ptr=None,  # [K], read when X_NORM
    X_NORM: tl.constexpr = False,  # ADD_NORM of x RMS-normed first (reference.sandwich_input)
    ACTIVATION: tl.constexpr = 0,  # GATED: act(gate) * up with SiLU (0) or gelu-tanh (1)
):
    tl.static_assert(SPLIT_K == 1 or PROLOGUE == 0 or QUANT != 0, "bf16 norm: no split-K")
    rows = tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn
    up_rows = w_rows + N.to(tl.int64) * stride_wn  # GATED: the up rows of these columns
    k_start, k_stop = split_k.k_range(K, k_per_split, SPLIT_K)
    # The epilogue's loads issued before the weight stream: after it, an unsplit program (gate_up)
    # ended on one more round trip, when nothing else was in flight.
    w_scale = tl.zeros([BLOCK_N], dtype=tl.float32)
    w_scale_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    if QUANT != 0:
        w_scale = tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
        if GATED:
            w_scale_up = tl.load(w_scale_ptr + N + cols, mask=col_mask, other=0.0)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    inv_rms_x = 0.0
    if X_NORM:  # the row's x-norm scale, before the weight's stream (its chunks need it)
        inv_rms_x = _x_inv_rms(x_ptr, K, eps, STATS_BLOCK)
    acc, acc_up = _project(
        x_ptr, residual_ptr, norm_weight_ptr, w_ptr, w_rows, up_rows, col_mask, sum_ptr,
        in_scale_ptr, M, K, k_start, k_stop, stride_xm, eps, PROLOGUE, GATED, BLOCK_M, BLOCK_N,
        BLOCK_K, STATS_BLOCK, DOT_PRECISION, QUANT, FP8_DOT, INTERPRETED, SWAP_AB=SWAP_AB,
        x_norm_weight_ptr=x_norm_weight_ptr, inv_rms_x=inv_rms_x, X_NORM=X_NORM,
    )  # fmt: skip
    if PROLOGUE == 2:
        _write_residual_sum(x_ptr, residual_ptr, sum_ptr, K, BLOCK_K, x_norm_weight_ptr,
                            inv_rms_x, X_NORM)  # fmt: skip
    if SPLIT_K > 1:
        # The tile's sums over all K: complete in the program that arrives last, the only one
        # whose stores below are unmasked.
        num_accs: tl.constexpr = 2 if GATED else 1
        part = rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N] offsets in one [M, N]
        part_mask = (rows < M)[:, None] & col_mask[None, :]
        mine = part_ptr + tl.program_id(1) * (num_accs * M * N)
        tl.store(mine + part, acc, mask=part_mask)
        if GATED:
            tl.store(mine + M * N + part, acc_up, mask=part_mask)
        is_last = split_k.arrive(counter_ptr, tl.program_id(0), cols, SPLIT_K)
        col_mask = col_mask & is_last
        part_mask = part_mask & is_last[None, :]
        acc = split_k.sum_partials(part_ptr, part, part_mask, num_accs * M * N, SPLIT_K)
        if GATED:
            acc_up = split_k.sum_partials(
                part_ptr + M * N, part, part_mask, num_accs * M * N, SPLIT_K
            )
    if QUANT != 0:  # the weight's per-row scales, after the sum as reference.fp8_linear
        acc *= w_scale[None, :]
        if GATED:
            acc_up *= w_scale_up[None, :]
    if HAS_BIAS:
        acc += bias[None, :]
    if GATED:
        # silu(gate) * up rounded as reference.silu_and_mul over the unfused projection's
        # output: gate and up to the model dtype, silu in fp32 to the dtype, the product again
        # (gelu-tanh's likewise, as reference.gelu_tanh_and_mul).
        dtype = out_ptr.dtype.element_ty
        gate = acc.to(dtype).to(tl.float32)
        if ACTIVATION == 1:
            act = _gelu_tanh_f32(gate).to(dtype).to(tl.float32)
        else:
            act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        acc = act * acc_up.to(dtype).to(tl.float32)
    out = out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & col_mask[None, :])


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


def _fits(
    x: torch.Tensor,
    weight: torch.Tensor,
    k: int,
    one_row: bool = False,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> bool:
    """Whether the kernel takes these operands (else the unfused path runs). The fused ops
    before the matmul take one row (batch-1 decode); the plain linear up to MAX_ROWS. With a
    weight_scale the weight is float8 (W8A8; input_scale static, or None: dynamic)."""
    if weight_scale is None:
        dtypes_ok = x.dtype == weight.dtype
    else:
        dtypes_ok = _fp8_weight_fits(weight, weight_scale) and (
            input_scale is None or input_scale.numel() == 1
        )
    return (
        0 < _rows(x) <= (1 if one_row else MAX_ROWS)
        and weight.stride(1) == 1  # rows may lie further apart than K (aligned rows)
        and weight.shape[1] == k
        and dtypes_ok
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
    )


def _fp8_weight_fits(weight: torch.Tensor, weight_scale: torch.Tensor) -> bool:
    return (
        weight.dtype == torch.float8_e4m3fn
        and weight_scale.dtype == torch.float32
        and weight_scale.is_contiguous()
        and weight_scale.numel() == weight.shape[0]
    )


def _quant_mode(
    weight_scale: torch.Tensor | None, input_scale: torch.Tensor | None, x: torch.Tensor
) -> int:
    """_project's QUANT for these operands (x already float8: its scale is per row when 2-D)."""
    if weight_scale is None:
        return 0
    if x.dtype == torch.float8_e4m3fn:
        return 3 if input_scale is not None and input_scale.dim() == 2 else 4
    return 1 if input_scale is None else 2


def swap_ab(quant: int, dot_rows: int, device: torch.device) -> bool:
    """_times' SWAP_AB for a launch of this QUANT whose dots take dot_rows weight rows: float8
    weights, in tiles of at least 64 rows on the GPU (a wgmma's M; below it Triton makes an HMMA
    of the swapped dot, with more registers than the plain one). The interpreter runs the same
    swapped code on its fp16-widened operands at its small tiles."""
    return quant != 0 and (device.type != "cuda" or dot_rows >= 64)


def _fp8_dot(device: torch.device) -> bool:
    """float8 x float8 dots on the GPU's tensor cores; the interpreter, which has no float8 dot,
    widens both operands to fp16 (exact)."""
    return device.type == "cuda"


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
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    x_norm_weight: torch.Tensor | None = None,
    activation: str = "silu",
) -> torch.Tensor:
    m = x2.shape[0]
    weight_rows, k = weight.shape
    n = weight_rows // 2 if gated else weight_rows
    out = torch.empty((m, n), dtype=out_dtype or x2.dtype, device=x2.device)
    kernel = ("linear" if prologue == _PLAIN else "norm_linear") + ("_silu_mul" if gated else "")
    quant = _quant_mode(weight_scale, input_scale, x2)
    tiles = small_batch_tiles.tile_config(
        kernel, weight_rows, k, x2.device, weight.element_size(), rows=m
    )
    block_n = tiles.block_n
    if gated and x2.device.type == "cuda":
        block_n //= 2  # the same bytes per step: BLOCK_N / 2 rows of gate and of up
    num_tiles = triton.cdiv(n, block_n)
    per_split, num_splits = split_k.k_per_split(k, tiles.split_k, tiles.block_k)
    if num_splits > 1 and prologue != _PLAIN and quant == 0:
        raise ValueError(f"{kernel} in {x2.dtype} takes no split-K (tiles {tiles})")
    part = counters = out
    if num_splits > 1:
        assert num_tiles <= split_k.MAX_TILES
        part = split_k.partials(num_splits, 2 if gated else 1, m, n, device=x2.device)
        counters = split_k.counters(x2.device)
    _small_batch_linear_kernel[(num_tiles, num_splits)](
        x2,
        residual if residual is not None else x2,
        norm_weight if norm_weight is not None else weight,
        weight,
        bias if bias is not None else weight,
        out,
        summed if summed is not None else out,
        weight_scale if weight_scale is not None else out,
        input_scale if input_scale is not None else out,
        part,
        counters,
        m,
        n,
        k,
        per_split,
        x2.stride(0),
        out.stride(0),
        weight.stride(0),
        eps,
        PROLOGUE=prologue,
        HAS_BIAS=bias is not None,
        GATED=gated,
        BLOCK_M=16,
        BLOCK_N=block_n,
        BLOCK_K=tiles.block_k,
        STATS_BLOCK=tiles.stats_block or tiles.block_k,
        SPLIT_K=num_splits,
        DOT_PRECISION=dot_precision(x2.dtype),
        QUANT=quant,
        FP8_DOT=_fp8_dot(x2.device),
        INTERPRETED=x2.device.type != "cuda",
        SWAP_AB=swap_ab(quant, block_n, x2.device),
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        **_variant_args(x_norm_weight, activation),
    )
    return out


def _variant_args(x_norm_weight: torch.Tensor | None, activation: str) -> dict[str, object]:
    """The constexprs of the Gemma variants, passed only when set: a launch without them (every
    Llama launch) specialises exactly as before they existed."""
    args: dict[str, object] = {}
    if x_norm_weight is not None:
        args.update(x_norm_weight_ptr=x_norm_weight, X_NORM=True)
    if ACTIVATIONS[activation] != 0:
        args["ACTIVATION"] = ACTIVATIONS[activation]
    return args


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


def fp8_linear(
    x: torch.Tensor,  # [..., K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor; None: dynamic per token
    bias: torch.Tensor | None = None,  # [N] in the model dtype
) -> torch.Tensor:  # [..., N] in x.dtype
    """W8A8 (reference.fp8_linear): a handful of rows quantize and multiply in one kernel that
    reads the float8 weight once (half bf16's bytes); more rows quantize, then _scaled_mm."""
    if not _fits(x, weight, x.shape[-1], False, weight_scale, input_scale):
        return fp8_gemm.fp8_linear(x, weight, weight_scale, input_scale, bias)
    out = _launch_fp8_plain(_rows_2d(x), weight, bias, weight_scale, input_scale, gated=False)
    return out.view(*x.shape[:-1], weight.shape[0])


def fp8_matmul(
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3, quantized already (quantize_fp8 or a fused op)
    x_scale: torch.Tensor,  # [M, 1] per row, or [] / [1] per tensor, fp32
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    """reference.fp8_matmul: a handful of rows in the small-batch kernel (float8 input and its
    scale as given, the weight read once), more by fp8_gemm.fp8_matmul (_scaled_mm). The
    engine's plain FP8 projections quantize inside that kernel instead (fp8_linear); this serves
    inputs made by the op before with columns of its own (outlier columns' remainders)."""
    m = x_fp8.shape[0]
    fits = (
        0 < m <= MAX_ROWS
        and x_fp8.dtype == torch.float8_e4m3fn
        and x_fp8.stride(1) == 1
        and weight.stride(1) == 1
        and weight.shape[1] == x_fp8.shape[1]
        and _fp8_weight_fits(weight, weight_scale)
        and out_dtype in (torch.float32, torch.float16, torch.bfloat16)
        # one static scale ([] or [1]: QUANT 4), or one a row ([M, 1]: QUANT 3)
        and ((x_scale.numel() == 1 and x_scale.dim() < 2) or x_scale.shape == (m, 1))
    )
    if not fits:
        return fp8_gemm.fp8_matmul(x_fp8, x_scale, weight, weight_scale, bias, out_dtype)
    return _launch(
        _PLAIN, x_fp8, weight, bias, weight_scale=weight_scale, input_scale=x_scale,
        out_dtype=out_dtype,
    )  # fmt: skip


def _launch_fp8_plain(
    x2: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    gated: bool,
    activation: str = "silu",
) -> torch.Tensor:
    """One row is quantized inside the kernel; a few rows by quantize_fp8's kernel first (inside
    the matmul's loop it would quantize a whole 16-row tile per step, padding included)."""
    if x2.shape[0] == 1:
        return _launch(
            _PLAIN, x2, weight, bias, gated=gated, weight_scale=weight_scale,
            input_scale=input_scale, activation=activation,
        )  # fmt: skip
    x_fp8, x_scale = fp8_gemm.quantize_fp8(x2, input_scale)
    return _launch(
        _PLAIN, x_fp8, weight, bias, gated=gated, weight_scale=weight_scale, input_scale=x_scale,
        out_dtype=x2.dtype, activation=activation,
    )  # fmt: skip


def _fused_norm_fits(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
) -> bool:
    return (
        _fits(x, weight, x.shape[-1], True, weight_scale, input_scale)
        and norm_weight.dtype == x.dtype
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
    )


def _add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    x_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) as kernels of their own: the unfused path (x
    normed by x_norm_weight first, inside the add's kernel)."""
    if residual is None:
        return rms_norm(x, norm_weight, eps), x
    return fused_add_rms_norm(x, residual, norm_weight, eps, x_norm_weight)


def _any_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor | None,
    input_scale: torch.Tensor | None,
) -> torch.Tensor:
    """The projection alone: linear, or fp8_linear when the weight carries scales."""
    if weight_scale is None:
        return linear(x, weight, bias)
    return fp8_linear(x, weight, weight_scale, input_scale, bias)


def _norm_quant_fp8_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor | None,
    x_norm_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Above the small-batch rows, an FP8 projection's input is quantized by the norm's own
    kernel (add_rms_norm_quant_fp8), then the float8 GEMM: one pass fewer over the activations
    than norm, quantize_fp8, GEMM."""
    x2, r2 = _rows_2d(x).contiguous(), None if residual is None else _rows_2d(residual).contiguous()
    x_fp8, x_scale, summed = add_rms_norm_quant_fp8(
        x2, r2, norm_weight, eps, input_scale, x_norm_weight=x_norm_weight
    )
    out = fp8_gemm.fp8_matmul(x_fp8, x_scale, weight, weight_scale, bias, x.dtype)
    return out.view(*x.shape[:-1], weight.shape[0]), summed.view(x.shape)


def _launch_norm_fused(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gated: bool,
    weight_scale: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    x_norm_weight: torch.Tensor | None = None,
    activation: str = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows_2d(x)
    if residual is None:
        assert x_norm_weight is None, "lone_x_norm normed x already"
        out = _launch(
            _NORM, x2, weight, bias, norm_weight=norm_weight, eps=eps, gated=gated,
            weight_scale=weight_scale, input_scale=input_scale, activation=activation,
        )  # fmt: skip
        return out, x
    # A new tensor, never x or residual: every program reads all of those while the others
    # write their slices of the sum.
    summed = torch.empty_like(x2)
    out = _launch(
        _ADD_NORM, x2, weight, bias, _rows_2d(residual), norm_weight, eps, summed, gated=gated,
        weight_scale=weight_scale, input_scale=input_scale, x_norm_weight=x_norm_weight,
        activation=activation,
    )  # fmt: skip
    return out, summed.view(x.shape)


def add_rms_norm_linear(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K] (float8 e4m3 when weight_scale is given)
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,  # [N] fp32: an FP8 W8A8 projection
    input_scale: torch.Tensor | None = None,  # [] fp32 static; None: dynamic per token
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual); with no residual,
    (linear(rms_norm(x)), x); fp8_linear instead of linear when weight_scale is given; x is
    reference.sandwich_input(x) with x_norm_weight (normed inside the same kernels)."""
    x, x_norm_weight = lone_x_norm(x, residual, x_norm_weight, eps)
    if not _fused_norm_fits(x, residual, norm_weight, weight, weight_scale, input_scale):
        if weight_scale is not None:
            return _norm_quant_fp8_linear(
                x, residual, norm_weight, eps, weight, bias, weight_scale, input_scale,
                x_norm_weight,
            )  # fmt: skip
        normed, summed = _add_rms_norm(x, residual, norm_weight, eps, x_norm_weight)
        return linear(normed, weight, bias), summed
    out, summed = _launch_norm_fused(
        x, residual, norm_weight, eps, weight, bias, False, weight_scale, input_scale,
        x_norm_weight,
    )  # fmt: skip
    return out.view(*x.shape[:-1], weight.shape[0]), summed


def add_rms_norm_linear_silu_mul(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2N, K]: the gate projection's rows, then the up projection's
    weight_scale: torch.Tensor | None = None,  # [2N] fp32: an FP8 W8A8 projection
    input_scale: torch.Tensor | None = None,  # [] fp32 static; None: dynamic per token
    activation: str = "silu",  # or "gelu_pytorch_tanh" (GeGLU)
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, N], [num_tokens, K])
    """(silu_and_mul(add_rms_norm_linear(...)), x + residual): the Llama MLP up to its down
    projection. One kernel for one row: each program streams the gate rows of its output columns
    and the matching up rows, so SiLU-mul runs on its accumulators (at batch 1 its own kernel
    was 1.5 us plus a launch gap per layer); the plain gated kernel up to MAX_ROWS after the norm
    kernel; above that cuBLAS (or the FP8 GEMM) and the SiLU kernel. `activation`
    "gelu_pytorch_tanh": GeGLU's gelu-tanh in place of SiLU in each (a constexpr of the same
    kernels); x_norm_weight: x is reference.sandwich_input(x), normed in the norm's kernel."""
    act_and_mul = _act_and_mul(activation)
    x, x_norm_weight = lone_x_norm(x, residual, x_norm_weight, eps)
    scales = {"weight_scale": weight_scale, "input_scale": input_scale}
    if _fused_norm_fits(x, residual, norm_weight, weight, **scales):
        out, summed = _launch_norm_fused(
            x, residual, norm_weight, eps, weight, None, True, **scales,
            x_norm_weight=x_norm_weight, activation=activation,
        )  # fmt: skip
        return out.view(*x.shape[:-1], weight.shape[0] // 2), summed
    if weight_scale is not None and not _fits(x, weight, x.shape[-1], False, **scales):
        gate_up, summed = _norm_quant_fp8_linear(
            x, residual, norm_weight, eps, weight, None, weight_scale, input_scale, x_norm_weight
        )
        return act_and_mul(gate_up), summed
    normed, summed = _add_rms_norm(x, residual, norm_weight, eps, x_norm_weight)
    if not _fits(normed, weight, normed.shape[-1], False, **scales):
        gate_up = _any_linear(normed, weight, None, weight_scale, input_scale)
        return act_and_mul(gate_up), summed
    if weight_scale is None:
        out = _launch(_PLAIN, _rows_2d(normed), weight, None, gated=True, activation=activation)
    else:
        out = _launch_fp8_plain(
            _rows_2d(normed), weight, None, weight_scale, input_scale, True, activation
        )
    return out.view(*x.shape[:-1], weight.shape[0] // 2), summed


def add_rms_norm_linear_silu_mul_fp8(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2N, K] float8 e4m3: the gate rows, then the up rows
    weight_scale: torch.Tensor,  # [2N] fp32
    input_scale: torch.Tensor | None,  # [] fp32 static scale of x's norm; None: per token
    out_scale: torch.Tensor | None,  # [] fp32 static scale of the activation; None: per token
    activation: str = "silu",  # or "gelu_pytorch_tanh" (GeGLU)
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The FP8 MLP up to a down projection that takes float8 (reference's twin). Up to
    MAX_ROWS rows: add_rms_norm_linear_silu_mul's small-batch kernels, the activation in the
    model dtype (scale None), since the down projection's small-batch kernel quantizes one row
    inside itself. Above: the norm kernel quantizes gate_up's input, the FP8 GEMM, then the
    SiLU-mul kernel writes float8 and its scales (silu_and_mul_quant_fp8): no bf16 activation
    round trip, no quantize kernel before the down projection."""
    scales = {"weight_scale": weight_scale, "input_scale": input_scale}
    if _fits(x, weight, x.shape[-1], False, **scales):
        act, summed = add_rms_norm_linear_silu_mul(
            x, residual, norm_weight, eps, weight, **scales, activation=activation,
            x_norm_weight=x_norm_weight,
        )  # fmt: skip
        return act, None, summed
    x, x_norm_weight = lone_x_norm(x, residual, x_norm_weight, eps)
    gate_up, summed = _norm_quant_fp8_linear(
        x, residual, norm_weight, eps, weight, None, weight_scale, input_scale, x_norm_weight
    )
    quant = _act_and_mul(activation, quant=True)
    act, act_scale = quant(gate_up.reshape(-1, gate_up.shape[-1]), out_scale)
    return act, act_scale, summed
