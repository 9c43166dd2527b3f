"""The routed experts with 128x128 block-scaled float8 weights as grouped GEMMs (twin of
reference.fused_moe_fp8_block; DeepSeek-V3's and Qwen3's FP8 experts): the activations are
quantized per token-group of 128 inputs (fp8_block_gemm.quantize_fp8_groups: the hidden state,
then each (token, expert) pair's SiLU-and-mul output), the (token, expert) pairs sorted by
expert and padded to the row block as in fused_moe.py, and each row block multiplied by its
expert's float8 weights one 128-input block at a time, as fp8_block_gemm.py does for a dense
projection: each block's fp32 partial product scaled by the rows' group scales and the
columns' block scales before it joins the fp32 accumulator. The down GEMM's rows are weighted
by their routing weight and rounded to the model dtype, and the top-k rows of each token
summed. Ids of another rank's experts (expert parallelism) come out as rows of zeros.

No host sync: CUDA-graph capturable as fused_moe is. The tiles are not tuned on a GPU yet."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_BLOCK
from kiln.kernels.triton._moe_tiles import sorted_tile, store_pair_rows
from kiln.kernels.triton.fp8_block_gemm import quantize_fp8_groups
from kiln.kernels.triton.fused_moe import align_by_expert
from kiln.kernels.triton.silu_mul import silu_and_mul

# (BLOCK_M, BLOCK_N, num_warps); BLOCK_K is the scale block, 128. Unmeasured: fp8_block_gemm's
# choice for a dense projection of the same row count.
Tiles = tuple[int, int, int]
_INTERPRETER_TILES: Tiles = (16, 32, 4)
_DECODE_TILES: Tiles = (16, 64, 4)
_PREFILL_TILES: Tiles = (64, 128, 4)
_PREFILL_PAIRS = 1024  # pairs from which the larger row block pays for its padding


# A step's (token, expert) pair count takes any value: specialized (equals 1, divides by 16)
# it compiled new variants inside serving runs (two in a 1000/1000 run of Qwen3-30B-A3B).
@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_block_grouped_kernel(
    a_ptr,  # [num_pairs // A_PER_ROW, K] float8 e4m3
    a_scale_ptr,  # [num_pairs // A_PER_ROW, groups] fp32: each row's group scales
    w_ptr,  # [num_experts, N, K] float8 e4m3
    w_scale_ptr,  # [num_experts, N, groups] fp32: each row's scale of each K block
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] fp32 routing weights (read with MUL_WEIGHT only)
    sorted_pairs_ptr,  # [max_rows] int32
    block_experts_ptr,  # [max_rows / BLOCK_M] int32
    num_rows_ptr,  # [1] int32
    num_pairs,
    num_experts,  # block_experts' value num_experts: another rank's experts (zeros)
    N,
    K,
    groups,
    stride_a,
    stride_as,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    A_PER_ROW: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    INTERPRETED: tl.constexpr,  # the interpreter has no float8 dot: widen to fp32 (exact)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(num_rows_ptr):
        return  # past the padded list's real end: the worst case's spare blocks
    pairs, valid, expert, cols = sorted_tile(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                             BLOCK_M, BLOCK_N)  # fmt: skip
    if expert >= num_experts:  # another rank's experts: rows of zeros, no product
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        store_pair_rows(out_ptr, stride_out, zeros, pairs, valid, cols, N, weights_ptr, False)
        return
    col_mask = cols < N
    # Padding rows read row 0 (their products are never stored).
    a_rows = tl.where(valid, pairs // A_PER_ROW, 0).to(tl.int64)
    w_rows = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_scales = w_scale_ptr + expert * stride_se + cols.to(tl.int64) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, groups):
        ks = g * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_a + ks[None, :], mask=k_mask[None, :],
                    other=0.0)  # fmt: skip
        w = tl.load(w_rows + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        a_scale = tl.load(a_scale_ptr + a_rows * stride_as + g)
        w_scale = tl.load(w_scales + g, mask=col_mask, other=0.0)
        if INTERPRETED:
            part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(a, w, out_dtype=tl.float32)
        acc += part * a_scale[:, None] * w_scale[None, :]
    store_pair_rows(out_ptr, stride_out, acc, pairs, valid, cols, N, weights_ptr, MUL_WEIGHT)


def _grouped_gemm(
    a: torch.Tensor,
    a_scales: torch.Tensor,
    w: torch.Tensor,
    w_scales: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_per_row: int,
    mul_weight: bool,
    tiles: Tiles,
) -> None:
    sorted_pairs, block_experts, num_rows = aligned
    n, k = w.shape[1], w.shape[2]
    groups = triton.cdiv(k, FP8_BLOCK)
    if tuple(w_scales.shape) != (w.shape[0], n, groups) or a_scales.shape[1] != groups:
        raise ValueError(
            f"fused_moe_fp8_block: weights {tuple(w.shape)} with block scales "
            f"{tuple(w_scales.shape)}, activation scales {tuple(a_scales.shape)}"
        )
    block_m, block_n, num_warps = tiles
    w_scales = w_scales.float().contiguous()
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _fp8_block_grouped_kernel[grid](
        a, a_scales, w, w_scales, out, weights, sorted_pairs, block_experts, num_rows,
        out.shape[0], w.shape[0], n, k, groups, a.stride(0), a_scales.stride(0), w.stride(0),
        w.stride(1), w_scales.stride(0), w_scales.stride(1), out.stride(0),
        A_PER_ROW=a_per_row, MUL_WEIGHT=mul_weight, INTERPRETED=a.device.type != "cuda",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=FP8_BLOCK, num_warps=num_warps,
    )  # fmt: skip


def fused_moe_fp8_block(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden] float8 e4m3
    w2: torch.Tensor,  # [num_experts, hidden, inter] float8 e4m3
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    w13_scale: torch.Tensor | None = None,  # [E, 2 * inter, ceil(hidden / 128)] fp32 (required)
    w2_scale: torch.Tensor | None = None,  # [E, hidden, ceil(inter / 128)] fp32 (required)
) -> torch.Tensor:  # [num_tokens, hidden]
    if x.device.type != "cuda":
        tiles = _INTERPRETER_TILES
    else:
        tiles = _PREFILL_TILES if topk_ids.numel() >= _PREFILL_PAIRS else _DECODE_TILES
    return fused_moe_fp8_block_tiled(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                                     tiles)  # fmt: skip


def fused_moe_fp8_block_tiled(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    tiles: Tiles,  # (BLOCK_M, BLOCK_N, num_warps)
) -> torch.Tensor:
    """fused_moe_fp8_block at given tiles (tests run the GPU's under the interpreter)."""
    if w13_scale is None or w2_scale is None or w13_scale.dim() != 3 or w2_scale.dim() != 3:
        raise ValueError("fused_moe_fp8_block takes float8 experts with their block scales")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    w13, w2 = w13.contiguous(), w2.contiguous()
    aligned = align_by_expert(topk_ids, w13.shape[0], tiles[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    x_fp8, x_scales = quantize_fp8_groups(x)
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x_fp8, x_scales, w13, w13_scale, gate_up, weights, aligned, top_k, False,
                  tiles)  # fmt: skip
    act_fp8, act_scales = quantize_fp8_groups(silu_and_mul(gate_up))  # per (token, expert) pair
    down = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(act_fp8, act_scales, w2, w2_scale, down, weights, aligned, 1, True, tiles)
    return down.view(num_tokens, top_k, -1).sum(dim=1)  # accumulated in fp32, rounded once
