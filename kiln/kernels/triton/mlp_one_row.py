"""The FP8 MLP block of one row in one kernel: residual add, RMSNorm, gate_up, SiLU-mul and the
down projection (twin of reference.add_rms_norm_mlp_fp8).

Why: at batch-1 decode the block is two weight streams (gate_up's 117 MB and down's 59 MB of
float8 at Llama-3.1-8B's shapes), and as two kernels each pays its own fill and drain: gate_up
ran at ~3.5 TB/s and down at ~3.0 of the H200's 4.8 (benchmarks/results/
2026-12-05-h200-outlier-e2e-one-row-cost: 53 us a block, ~19.8 of it down). Down cannot start
until every column of the activation exists, so two kernels serialise the streams; a grid
barrier would make one kernel wait the same way.

How, with no barrier: the activation's columns are cut into chunks of BLOCK_C, and a program
owns one chunk all the way through. It streams the gate and up rows of its chunk (the norm of
the input row computed first, as small_batch_linear's one-row kernel does), finishes SiLU-mul on
its accumulators and quantizes the chunk with down's static input scale (a dynamic scale would
need every chunk's absmax: not fused), then streams down's columns of its chunk, tile of
BLOCK_H outputs by tile, into fp32 partial sums of every output ([chunks, hidden], one row per
program). A program's down stream overlaps the other programs' gate_up streams, so HBM sees one
stream, not two with a gap.

The partial sums meet per output tile as split-K's do (split_k.py): each program stores its tile
and takes a ticket from the tile's counter; the program with the last ticket sums the chunks in
a fixed order (the same bits run to run), scales and stores the tile. Programs visit the tiles in
rotated order (program p starts at tile p), so the last tickets, and the sums, fall to many
programs rather than all to the one that finishes last.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kiln.envs import envs
from kiln.kernels.triton import small_batch_linear, split_k
from kiln.kernels.triton._device import dot_precision
from kiln.kernels.triton.small_batch_linear import (
    _ADD_NORM,
    _NORM,
    _fp8_dot,
    _fp8_weight_fits,
    _project,
    _quantize,
    _write_residual_sum,
    add_rms_norm_linear_silu_mul_fp8,
    fp8_linear,
    fp8_matmul,
)


class MlpTiles(NamedTuple):
    block_c: int  # activation columns a program owns (gate_up rows of gate and of up, down columns)
    block_k: int  # hidden per step of the gate_up stream
    block_h: int  # down's outputs per tile
    num_warps: int
    num_stages: int
    stats_block: int  # hidden per step of the passes over the input row before the stream


# Llama-3.1-8B's block on the GPU: not yet swept (benchmarks/mlp_one_row_sweep.py); 224 programs.
GPU_TILES = MlpTiles(64, 256, 128, 4, 3, 1024)
# The interpreter: small steps, so tiny test shapes have several chunks and tiles.
INTERPRETER_TILES = MlpTiles(16, 32, 16, 4, 1, 32)


def _gpu_tiles() -> MlpTiles:
    """GPU_TILES, or KILN_MLP_ONE_KERNEL_TILES's six numbers."""
    forced = envs().mlp_one_kernel_tiles
    return MlpTiles(*(int(v) for v in forced.split(","))) if forced else GPU_TILES


@triton.jit
def _mlp_one_row_fp8_kernel(
    x_ptr,  # [1, H]
    residual_ptr,  # [1, H], read when ADD_NORM
    norm_weight_ptr,  # [H]
    sum_ptr,  # [1, H]: x + residual, written when ADD_NORM
    gate_up_ptr,  # [2 INTER, H] float8: gate rows, then up rows
    gate_up_scale_ptr,  # [2 INTER] fp32
    gate_up_in_scale_ptr,  # [] fp32 static scale of the normed row (unread when DYNAMIC)
    down_ptr,  # [H, INTER] float8
    down_scale_ptr,  # [H] fp32
    down_in_scale_ptr,  # [] fp32 static scale of the activation
    part_ptr,  # [chunks, H] fp32 partial sums
    counter_ptr,  # [tiles] int32 zeros (split_k.counters)
    out_ptr,  # [1, H]
    H,
    INTER,
    stride_gate_up,
    stride_down,
    eps,
    PROLOGUE: tl.constexpr,  # small_batch_linear's _NORM or _ADD_NORM
    DYNAMIC: tl.constexpr,  # gate_up's input scale per row (found here) instead of static
    NUM_CHUNKS: tl.constexpr,
    BLOCK_C: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STATS_BLOCK: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP8_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    FP8_MAX: tl.constexpr = 448.0,
    SUM_ROWS: tl.constexpr = 32,  # partial rows a load of the tile's sum
):
    chunk = tl.program_id(0)
    cols = chunk * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < INTER
    gate_rows = gate_up_ptr + cols[:, None].to(tl.int64) * stride_gate_up
    up_rows = gate_rows + INTER.to(tl.int64) * stride_gate_up
    gate, up = _project(
        x_ptr, residual_ptr, norm_weight_ptr, gate_up_ptr, gate_rows, up_rows, col_mask, sum_ptr,
        gate_up_in_scale_ptr, 1, H, 0, H, H, eps, PROLOGUE, True, 16, BLOCK_C, BLOCK_K,
        STATS_BLOCK, DOT_PRECISION, 1 if DYNAMIC else 2, FP8_DOT, INTERPRETED,
    )  # fmt: skip
    if PROLOGUE == 2:
        _write_residual_sum(x_ptr, residual_ptr, sum_ptr, H, BLOCK_K)
    # SiLU-mul rounded as reference.silu_and_mul over the unfused projection's output (gate and
    # up to the model dtype, silu to the dtype, the product again), then quantized as
    # reference.quantize_fp8 with down's static scale. Rows 1-15 of the dot's tile are zeros.
    dtype = out_ptr.dtype.element_ty
    gate_scale = tl.load(gate_up_scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    up_scale = tl.load(gate_up_scale_ptr + INTER + cols, mask=col_mask, other=0.0)[None, :]
    gate = (gate * gate_scale).to(dtype).to(tl.float32)
    up = (up * up_scale).to(dtype)
    act = ((gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up.to(tl.float32)).to(dtype)
    down_in_scale = tl.load(down_in_scale_ptr)
    inv_scale = tl.math.div_rn(1.0, down_in_scale)
    a = _quantize(
        act.to(tl.float32), down_in_scale, inv_scale, False, FP8_DOT, FP8_MAX, INTERPRETED
    )
    widen: tl.constexpr = not FP8_DOT

    hs = tl.arange(0, BLOCK_H)
    num_tiles = tl.cdiv(H, BLOCK_H)
    for step in range(0, num_tiles):
        tile = (step + chunk) % num_tiles
        outs = tile * BLOCK_H + hs
        out_mask = outs < H
        w = tl.load(
            down_ptr + outs[:, None].to(tl.int64) * stride_down + cols[None, :],
            mask=out_mask[:, None] & col_mask[None, :],
            other=0.0,
        )
        if widen:
            w = w.to(tl.float16)
        partial = tl.sum(tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION), 0)  # row 0's
        tl.store(part_ptr + chunk * H + outs, partial, mask=out_mask)
        ticket = split_k.ticket(counter_ptr, tile, NUM_CHUNKS)
        if ticket == NUM_CHUNKS - 1:
            # Every chunk's partials of this tile are stored: sum them (from L2, .cg: written by
            # other programs during this launch), SUM_ROWS chunks a load in a fixed order. An
            # unrolled loop: Triton pipelines no loop that holds another, and this one's loads
            # of down's tiles must stay pipelined.
            total = tl.zeros([BLOCK_H], dtype=tl.float32)
            for first in tl.static_range(0, NUM_CHUNKS, SUM_ROWS):
                chunks = first + tl.arange(0, SUM_ROWS)
                total += tl.sum(
                    tl.load(
                        part_ptr + chunks[:, None] * H + outs[None, :],
                        mask=(chunks < NUM_CHUNKS)[:, None] & out_mask[None, :],
                        other=0.0,
                        cache_modifier=".cg",
                    ),
                    0,
                )
            # As reference.fp8_matmul: the sum times the input scale, then the weight's.
            total = total * down_in_scale * tl.load(down_scale_ptr + outs, mask=out_mask, other=0.0)
            tl.store(out_ptr + outs, total.to(dtype), mask=out_mask)


def fits(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_scale: torch.Tensor,
    down_input_scale: torch.Tensor | None,
) -> bool:
    """Whether the one-kernel block takes these operands: one row, float8 weights with per-row
    scales, rows contiguous, and a static activation scale for down."""
    hidden = x.shape[-1]
    return (
        small_batch_linear.MAX_ROWS >= 1  # KILN_FUSED_LINEAR_MAX_ROWS=0: no fused kernels
        and x.numel() == hidden
        and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and x.is_contiguous()
        and norm_weight.dtype == x.dtype
        and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()))
        and _fp8_weight_fits(gate_up_weight, gate_up_scale)
        and _fp8_weight_fits(down_weight, down_scale)
        and gate_up_weight.stride(1) == 1
        and down_weight.stride(1) == 1
        and gate_up_weight.shape[1] == hidden
        and down_weight.shape == (hidden, gate_up_weight.shape[0] // 2)
        and (gate_up_input_scale is None or gate_up_input_scale.numel() == 1)
        and down_input_scale is not None
        and down_input_scale.numel() == 1
    )


def add_rms_norm_mlp_fp8(
    x: torch.Tensor,  # [num_tokens, H]
    residual: torch.Tensor | None,  # [num_tokens, H], or None: no residual to add
    norm_weight: torch.Tensor,  # [H]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2I, H] float8 e4m3: the gate rows, then the up rows
    gate_up_scale: torch.Tensor,  # [2I] fp32
    gate_up_input_scale: torch.Tensor | None,  # [] fp32 static scale of x's norm; None: per token
    down_weight: torch.Tensor,  # [H, I] float8 e4m3
    down_scale: torch.Tensor,  # [H] fp32
    down_input_scale: torch.Tensor | None,  # [] fp32 static scale of the activation, or None
) -> tuple[torch.Tensor, torch.Tensor]:  # (down(silu(gate) * up), x + residual)
    """The FP8 MLP block (reference.add_rms_norm_mlp_fp8): one kernel for one row with a static
    activation scale for down; otherwise two_kernels."""
    weights = (gate_up_weight, gate_up_scale, gate_up_input_scale, down_weight, down_scale)
    block = launch if fits(x, residual, norm_weight, *weights, down_input_scale) else two_kernels
    return block(x, residual, norm_weight, eps, *weights, down_input_scale)


def two_kernels(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_scale: torch.Tensor,
    down_input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block as the decoder runs it without the one kernel: norm + gate_up + SiLU-mul
    (add_rms_norm_linear_silu_mul_fp8), then down."""
    act, act_scale, summed = add_rms_norm_linear_silu_mul_fp8(
        x, residual, norm_weight, eps, gate_up_weight, gate_up_scale, gate_up_input_scale,
        down_input_scale,
    )  # fmt: skip
    if act_scale is None:  # the small-batch rows: down quantizes the activation itself
        return fp8_linear(act, down_weight, down_scale, down_input_scale), summed
    out = fp8_matmul(act, act_scale, down_weight, down_scale, None, x.dtype)
    return out.view(*x.shape[:-1], down_weight.shape[0]), summed


def launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_scale: torch.Tensor,
    down_input_scale: torch.Tensor,
    tiles: MlpTiles | None = None,  # a sweep's choice; None: GPU_TILES / INTERPRETER_TILES
) -> tuple[torch.Tensor, torch.Tensor]:
    """The one-kernel block, for operands fits() takes."""
    hidden = x.shape[-1]
    inter = down_weight.shape[1]
    on_gpu = x.device.type == "cuda"
    tiles = tiles or (_gpu_tiles() if on_gpu else INTERPRETER_TILES)
    num_chunks = triton.cdiv(inter, tiles.block_c)
    num_tiles = triton.cdiv(hidden, tiles.block_h)
    assert num_tiles <= split_k.MAX_TILES
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    part = torch.empty((num_chunks, hidden), dtype=torch.float32, device=x.device)
    _mlp_one_row_fp8_kernel[(num_chunks,)](
        x,
        residual if residual is not None else x,
        norm_weight,
        summed,
        gate_up_weight,
        gate_up_scale,
        gate_up_input_scale if gate_up_input_scale is not None else gate_up_scale,
        down_weight,
        down_scale,
        down_input_scale,
        part,
        split_k.counters(x.device),
        out,
        hidden,
        inter,
        gate_up_weight.stride(0),
        down_weight.stride(0),
        eps,
        PROLOGUE=_ADD_NORM if residual is not None else _NORM,
        DYNAMIC=gate_up_input_scale is None,
        NUM_CHUNKS=num_chunks,
        BLOCK_C=tiles.block_c,
        BLOCK_K=tiles.block_k,
        BLOCK_H=tiles.block_h,
        STATS_BLOCK=tiles.stats_block,
        DOT_PRECISION=dot_precision(x.dtype),
        FP8_DOT=_fp8_dot(x.device),
        INTERPRETED=not on_gpu,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out, summed
