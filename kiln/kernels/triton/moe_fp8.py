"""The routed experts as float8 tensor-core grouped GEMMs (twin of reference.fused_moe_fp8), for
float8 experts at prefill sizes: the activations are quantized per row (a token's hidden state,
then each (token, expert) pair's SiLU-and-mul output, dynamic scales: absmax / 448), the (token,
expert) pairs sorted by expert and padded to the row block as in fused_moe.py, and each row block
multiplied by its expert's float8 weights with `tl.dot` on float8 operands, accumulated in fp32;
the activation's row scale and the weights' scale (per expert or per output channel) are applied
in the epilogue, the down GEMM's rows also by their routing weight (and rounded to the model
dtype), and the top-k rows of each token summed.

The loads carry no masks where the shapes allow (padding rows read row 0, columns wrap modulo N,
K divisible by BLOCK_K) so the software pipeline issues plain asynchronous copies. No host sync:
CUDA-graph capturable as fused_moe is."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._moe_tiles import sorted_tile, store_pair_rows
from kiln.kernels.triton.fp8_gemm import quantize_fp8
from kiln.kernels.triton.fused_moe import align_by_expert
from kiln.kernels.triton.silu_mul import silu_and_mul_quant_fp8

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, TMA: the weight tiles by the Hopper tensor
# memory accelerator, 1, or by per-thread pointer loads, 0). The kernel benchmark
# (benchmarks/kernels_gpu.py --only moe) sweeps FP8_TILE_CANDIDATES.
Tiles = tuple[int, int, int, int, int, int]
_INTERPRETER_TILES: Tiles = (16, 32, 32, 4, 1, 0)
DEFAULT_TILES: Tiles = (64, 128, 128, 4, 4, 0)
# Prefill-sized steps: at Qwen3-30B-A3B's 8192 tokens (512 rows an expert) on an H100 the best
# of the sweep, the whole grouped GEMM 1541 -> 1231 us (41% -> 51% of the FP8 peak; gate_up
# alone 61% -> 84%); the wide tiles pad each expert's rows to 128, so fewer rows keep the default.
LARGE_TILES: Tiles = (128, 256, 128, 8, 3, 0)
LARGE_ROWS_PER_EXPERT = 256


def default_tiles(num_pairs: int, num_experts: int, device: torch.device) -> Tiles:
    """The grouped GEMM's tiles for a step routing num_pairs (token, expert) pairs."""
    if device.type != "cuda":
        return _INTERPRETER_TILES
    if num_pairs >= LARGE_ROWS_PER_EXPERT * num_experts:
        return LARGE_TILES
    return DEFAULT_TILES


FP8_TILE_CANDIDATES: tuple[Tiles, ...] = tuple(
    (*tiles, tma)
    for tma in (0, 1)
    for tiles in (
        (64, 128, 128, 4, 4),
        (64, 128, 128, 4, 3),
        (128, 128, 128, 8, 4),
        (128, 128, 128, 8, 3),
        (64, 256, 128, 8, 3),
        (128, 256, 128, 8, 3),
        (128, 128, 64, 4, 4),
    )
)


# A step's (token, expert) pair count takes any value: specialized (equals 1, divides by 16)
# it compiled new variants inside serving runs (two in a 1000/1000 run of Qwen3-30B-A3B).
@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_grouped_gemm_kernel(
    a_ptr,  # [num_pairs // A_PER_ROW, K] float8 e4m3
    a_scale_ptr,  # [num_pairs // A_PER_ROW] fp32: each row's scale
    w_ptr,  # [num_experts, N, K] float8 e4m3
    w_desc,  # with TMA: a descriptor of w as [num_experts * N, K], [BLOCK_N, BLOCK_K] blocks
    w_scale_ptr,  # [num_experts] or [num_experts, N] fp32
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] fp32 routing weights (read with MUL_WEIGHT only)
    sorted_pairs_ptr,  # [max_rows] int32
    block_experts_ptr,  # [max_rows / BLOCK_M] int32
    num_rows_ptr,  # [1] int32
    num_pairs,
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,  # 0 for a per-expert scale
    stride_out,
    A_PER_ROW: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no mask on the reduction
    INTERPRETED: tl.constexpr,  # the interpreter has no float8 dot: widen to fp32 (exact)
    TMA: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(num_rows_ptr):
        return  # past the padded list's real end: the worst case's spare blocks
    pairs, valid, expert, cols = sorted_tile(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                             BLOCK_M, BLOCK_N)  # fmt: skip
    # Padding rows read row 0 (their products are never stored): no mask on the A loads.
    a_rows = tl.where(valid, pairs // A_PER_ROW, 0).to(tl.int64)
    w_cols = (cols % N).to(tl.int64)  # wrapped: the columns past N are computed, never stored
    a_tile = a_ptr + a_rows[:, None] * stride_a
    w_tile = w_ptr + expert * stride_we + w_cols[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # The TMA block's first row: columns past N read the next expert's rows (or zeros past
    # the last), computed and never stored, as the wrapped pointer columns are.
    desc_row = (expert * N + tl.program_id(1) * BLOCK_N).to(tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(a_tile + ks[None, :])
        else:
            a = tl.load(a_tile + ks[None, :], mask=ks[None, :] < K, other=0.0)
        if TMA:  # out-of-range K reads zeros
            w = tl.trans(w_desc.load([desc_row, k0]))
        elif EVEN_K:
            w = tl.load(w_tile + ks[:, None])  # [BLOCK_K, BLOCK_N]: K-major, as wgmma wants
        else:
            w = tl.load(w_tile + ks[:, None], mask=ks[:, None] < K, other=0.0)
        if INTERPRETED:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:  # Hopper's float8 accumulation without promotion (Triton's default on sm_90;
            # fast accumulation, as kiln's dense float8 GEMMs run)
            acc = tl.dot(a, w, acc)
    a_scale = tl.load(a_scale_ptr + a_rows)
    w_scale = tl.load(w_scale_ptr + expert * stride_se + w_cols * stride_sn)
    acc *= a_scale[:, None] * w_scale[None, :]
    store_pair_rows(out_ptr, stride_out, acc, pairs, valid, cols, N, weights_ptr, MUL_WEIGHT)


def _fp8_grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    w: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_per_row: int,
    mul_weight: bool,
    tiles: Tiles,
) -> None:
    sorted_pairs, block_experts, num_rows = aligned
    n, k = w.shape[1], w.shape[2]
    block_m, block_n, block_k, num_warps, num_stages, tma = tiles
    # TMA rows must start 16-byte aligned: one float8 row of K bytes.
    desc = None
    if tma and k % 16 == 0:
        # Imported here: host descriptors are recent in Triton; kiln asks for 3.0 and up.
        from triton.tools.tensor_descriptor import TensorDescriptor

        desc = TensorDescriptor.from_tensor(w.view(-1, k), [block_n, block_k])
    stride_sn = w_scale.stride(1) if w_scale.dim() == 2 else 0
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    _fp8_grouped_gemm_kernel[grid](
        a, a_scale, w, desc, w_scale, out, weights, sorted_pairs, block_experts, num_rows,
        out.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), w_scale.stride(0), stride_sn,
        out.stride(0), A_PER_ROW=a_per_row, MUL_WEIGHT=mul_weight, EVEN_K=k % block_k == 0,
        INTERPRETED=a.device.type != "cuda", TMA=desc is not None, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


def fused_moe_fp8(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden] float8 e4m3
    w2: torch.Tensor,  # [num_experts, hidden, inter] float8 e4m3
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    w13_scale: torch.Tensor | None = None,  # [E] or [E, 2 * inter] fp32 (required)
    w2_scale: torch.Tensor | None = None,  # [E] or [E, hidden] fp32 (required)
) -> torch.Tensor:  # [num_tokens, hidden]
    tiles = default_tiles(topk_ids.numel(), w13.shape[0], x.device)
    return fused_moe_fp8_tiled(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, tiles)


def fused_moe_fp8_tiled(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    tiles: Tiles,  # see DEFAULT_TILES
) -> torch.Tensor:
    """fused_moe_fp8 at given tiles (tests run the GPU's under the interpreter; the kernel
    benchmark sweeps them)."""
    if w13_scale is None or w2_scale is None:
        raise ValueError("fused_moe_fp8 takes float8 experts with their scales")
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    w13, w2 = w13.contiguous(), w2.contiguous()
    aligned = align_by_expert(topk_ids, w13.shape[0], tiles[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    x_fp8, x_scale = quantize_fp8(x, None)  # per token
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    _fp8_grouped_gemm(x_fp8, x_scale, w13, w13_scale, gate_up, weights, aligned, top_k, False,
                      tiles)  # fmt: skip
    act_fp8, act_scale = silu_and_mul_quant_fp8(gate_up, None)  # per (token, expert) pair
    # Weighted rows in x's dtype (as transformers' experts' outputs are): fp32 rows would
    # double the bytes the GEMM writes and the sum reads (1 GB at 8192 tokens of Qwen3-30B-A3B).
    down = torch.empty(num_pairs, w2.shape[1], dtype=x.dtype, device=x.device)
    _fp8_grouped_gemm(act_fp8, act_scale, w2, w2_scale, down, weights, aligned, 1, True, tiles)
    return down.view(num_tokens, top_k, -1).sum(dim=1)  # accumulated in fp32, rounded once
