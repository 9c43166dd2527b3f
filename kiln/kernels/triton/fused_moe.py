"""The routed experts as two grouped GEMMs (twin of reference.fused_moe), the fused-MoE design
vLLM and SGLang use: the (token, expert) pairs are sorted by expert and each expert's run padded
to the GEMM's row block, so every row block of the sorted list belongs to one expert; one launch
multiplies each block by its expert's weights (gate_up), the SiLU-mul kernel (gpt-oss: the
clamped SwiGLU's) runs over the pairs, a second launch multiplies by the experts' down weights
and scales each row by its routing weight, and the top-k rows of each token are summed in token
order. Float8 (or int8) weights carry a scale per expert, per output channel, or per row and
128 inputs (W8A16 in groups of 128: the codes scaled, weight-only); gpt-oss's experts add a
bias to each projection's output (the down bias before the routing weight).

The sort is torch ops with shapes fixed by the token count alone (no host sync), so a CUDA graph
can capture it: the padded list is sized for the worst case, num_pairs + num_experts *
(BLOCK_M - 1) rows, and the blocks past the real end return at once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._device import dot_precision
from kiln.kernels.triton._moe_tiles import sorted_tile, store_pair_rows
from kiln.kernels.triton.clamped_swiglu import clamped_swiglu
from kiln.kernels.triton.silu_mul import silu_and_mul

# (BLOCK_M, BLOCK_N, BLOCK_K): rows of a block (one expert's (token, expert) pairs, padded),
# output columns, reduction step. The interpreter's cost grows with the tiles; 16 is tl.dot's
# least M, which decode's few pairs per expert barely fill; prefill's many fill 64.
_INTERPRETER_TILES = (16, 32, 32)
_DECODE_TILES = (16, 64, 128)
_PREFILL_TILES = (64, 128, 64)
_PREFILL_PAIRS = 1024  # pairs from which the larger row block pays for its padding


def _tiles(num_pairs: int, device: torch.device) -> tuple[int, int, int]:
    if device.type != "cuda":
        return _INTERPRETER_TILES
    return _PREFILL_TILES if num_pairs >= _PREFILL_PAIRS else _DECODE_TILES


def align_by_expert(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_pairs [max_rows] int32: each row's flat (token * top_k + k) pair index, or
    num_pairs for padding; block_experts [max_rows / block_m] int32: each row block's expert;
    num_rows [1] int32: the padded rows in use), the pairs grouped by expert (stable, so in token
    order within an expert) and each expert's run padded to a multiple of `block_m`. Ids outside
    [0, num_experts) (another rank's experts under expert parallelism) go last, as expert
    `num_experts`, whose blocks the GEMMs skip and whose rows come out zero."""
    flat = topk_ids.reshape(-1).to(torch.int64)
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    num_pairs = flat.numel()
    max_rows = num_pairs + (num_experts + 1) * (block_m - 1)
    max_rows = triton.cdiv(max_rows, block_m) * block_m
    # scatter_add, not bincount: bincount sizes its output by a max it reads back (a host sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    # A pair's place: its expert's padded start plus its rank among that expert's pairs.
    rank = torch.arange(num_pairs, device=flat.device) - (torch.cumsum(counts, 0) - counts)[experts]
    dest = (padded_end - padded)[experts] + rank
    sorted_pairs = torch.full((max_rows,), num_pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[dest] = order.to(torch.int32)
    block_starts = torch.arange(0, max_rows, block_m, device=flat.device)
    block_experts = torch.searchsorted(padded_end, block_starts, right=True)
    block_experts = block_experts.clamp(max=num_experts).to(torch.int32)
    return sorted_pairs, block_experts, padded_end[-1:].to(torch.int32)


# A step's (token, expert) pair count takes any value: specialized (equals 1, divides by 16)
# it compiled new variants inside serving runs (two in a 1000/1000 run of Qwen3-30B-A3B).
@triton.jit(do_not_specialize=["num_pairs"])
def _grouped_gemm_kernel(
    a_ptr,  # [num_pairs // a_per_row, K]: the rows each pair reads (a token's, or its own)
    w_ptr,  # [num_experts, N, K]
    out_ptr,  # [num_pairs, N]
    weights_ptr,  # [num_pairs] fp32 routing weights (read with MUL_WEIGHT only)
    scale_ptr,  # [num_experts] (or [num_experts, N] PER_CHANNEL) fp32: float8 weights' scales;
    # with INT4, [num_experts, N, K / GROUP] group scales; with ROW_BLOCKS [E, N, K / 128]
    zero_ptr,  # [num_experts, N, K / GROUP] fp32: INT4 zero points (read with INT4 only)
    bias_ptr,  # [num_experts, N]: each expert's output bias (read with HAS_BIAS only)
    sorted_pairs_ptr,  # [max_rows] int32
    block_experts_ptr,  # [max_rows / BLOCK_M] int32
    num_rows_ptr,  # [1] int32
    num_pairs,
    num_experts,  # block_experts' value num_experts: pairs of no expert here (skipped)
    N,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    stride_se,  # INT4 scales' and zeros' strides (read with INT4 only)
    stride_sn,
    A_PER_ROW: tl.constexpr,  # pairs sharing one row of a (top_k for the token's hidden state)
    MUL_WEIGHT: tl.constexpr,
    SCALED: tl.constexpr,  # float8 weights: widened to a's dtype (exact), the sums scaled
    PER_CHANNEL: tl.constexpr,  # the scales are per output column (gpt-oss's MXFP4 as FP8)
    ROW_BLOCKS: tl.constexpr,  # 8-bit codes with a scale per row and 128 inputs (W8A16 g128):
    # the tile's codes times their scales, rounded to a's dtype before the dot
    HAS_BIAS: tl.constexpr,  # added after the scale, before the routing weight (gpt-oss)
    INT4: tl.constexpr,  # w: [num_experts, N, K / 8] int32 words of 8 codes, dequantized here
    GROUP: tl.constexpr,  # with INT4: inputs per scale and zero
    DOT_PRECISION: tl.constexpr,
    INTERPRETED: tl.constexpr,  # the interpreter's bf16 tl.dot returns garbage: widen first
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    if tl.program_id(0) * BLOCK_M >= tl.load(num_rows_ptr):
        return  # past the padded list's real end: the worst case's spare blocks
    pairs, valid, expert, cols = sorted_tile(sorted_pairs_ptr, block_experts_ptr, num_pairs,
                                             BLOCK_M, BLOCK_N)  # fmt: skip
    a_rows = (pairs // A_PER_ROW).to(tl.int64)
    if expert >= num_experts:  # another rank's experts: rows of zeros, no product
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        store_pair_rows(out_ptr, stride_out, zeros, pairs, valid, cols, N, weights_ptr, False)
        return
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_a + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        w_mask = (cols[None, :] < N) & (ks[:, None] < K)
        w_rows = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
        if INT4:  # the tile's codes widened in registers: (code - zero) * scale in a's dtype
            # Each word loaded once and fanned out to its 8 codes (int4_gemm's tile).
            words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            words_mask = (cols[None, :] < N) & (words_k < K // 8)[:, None]
            words = tl.load(w_rows + words_k[:, None], mask=words_mask, other=0)
            words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)),
                               (BLOCK_K, BLOCK_N))  # fmt: skip
            codes = ((words >> ((ks % 8) * 4)[:, None]) & 0xF).to(tl.float32)
            at = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
            if GROUP % BLOCK_K == 0:  # the tile within one group: a scale and zero a column
                at += k0 // GROUP
                col_mask = cols[None, :] < N
                zero = tl.load(zero_ptr + at, mask=col_mask, other=0.0)
                scale = tl.load(scale_ptr + at, mask=col_mask, other=0.0)
            else:
                at += (ks // GROUP)[:, None]
                zero = tl.load(zero_ptr + at, mask=w_mask, other=0.0)
                scale = tl.load(scale_ptr + at, mask=w_mask, other=0.0)
            w = ((codes - zero) * scale).to(a.dtype)
        elif ROW_BLOCKS:
            w = tl.load(w_rows + ks[:, None], mask=w_mask, other=0.0).to(tl.float32)
            at = expert * stride_se + cols[None, :].to(tl.int64) * stride_sn
            scale = tl.load(scale_ptr + at + (ks // 128)[:, None], mask=w_mask, other=0.0)
            w = (w * scale).to(a.dtype)
        else:  # [BLOCK_K, BLOCK_N]: the expert's rows `cols`, transposed
            w = tl.load(w_rows + ks[:, None], mask=w_mask, other=0.0)
        if INTERPRETED:
            a, w = a.to(tl.float32), w.to(tl.float32)
        elif SCALED:
            w = w.to(a.dtype)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    if SCALED and not ROW_BLOCKS:
        if PER_CHANNEL:
            channel_scale = tl.load(scale_ptr + expert * N + cols, mask=cols < N, other=0.0)
            acc *= channel_scale[None, :]
        else:
            acc *= tl.load(scale_ptr + expert)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert * N + cols, mask=cols < N, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    store_pair_rows(out_ptr, stride_out, acc, pairs, valid, cols, N, weights_ptr, MUL_WEIGHT)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    aligned: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_per_row: int,
    mul_weight: bool,
    tiles: tuple[int, int, int],
    int4: tuple[torch.Tensor, torch.Tensor] | None = None,  # INT4 codes' (scales, zeros)
) -> None:
    sorted_pairs, block_experts, num_rows = aligned
    n, k = w.shape[1], w.shape[2] * (8 if int4 is not None else 1)
    block_m, block_n, block_k = tiles
    grid = (block_experts.numel(), triton.cdiv(n, block_n))
    if scale is not None:
        scale = scale.float().contiguous()
    if bias is not None:
        bias = bias.contiguous()
    group_scale, zero, group = weights, weights, 1
    if int4 is not None:
        group_scale, zero = int4[0].float().contiguous(), int4[1].float().contiguous()
        group = k // group_scale.shape[-1]
    row_blocks = False
    if scale is not None and scale.dim() == 3:  # its strides are the kernel's stride_se / _sn
        group_scale, row_blocks = scale, True
    _grouped_gemm_kernel[grid](
        a, w, out, weights, group_scale if scale is None else scale, zero,
        weights if bias is None else bias, sorted_pairs, block_experts, num_rows, out.shape[0],
        w.shape[0], n, k, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        group_scale.stride(0), group_scale.stride(1) if group_scale.dim() > 1 else 0,
        A_PER_ROW=a_per_row, MUL_WEIGHT=mul_weight, SCALED=scale is not None,
        PER_CHANNEL=scale is not None and scale.dim() == 2, ROW_BLOCKS=row_blocks,
        HAS_BIAS=bias is not None,
        INT4=int4 is not None, GROUP=group,
        DOT_PRECISION=dot_precision(a.dtype),
        INTERPRETED=a.device.type != "cuda",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's [gate; up] rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]: each expert's down projection
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32: each chosen expert's weight
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int: the chosen experts
    w13_scale: torch.Tensor | None = None,  # [E], [E, 2 * inter] or [E, 2 * inter, K / 128]
    w2_scale: torch.Tensor | None = None,  # [E], [E, hidden] or [E, hidden, inter / 128] fp32
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * inter]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    swiglu: tuple[float, float] | None = None,  # gpt-oss's clamped SwiGLU (alpha, limit)
) -> torch.Tensor:  # [num_tokens, hidden]
    tiles = _tiles(topk_ids.numel(), x.device)
    return fused_moe_tiled(
        x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, tiles, w13_bias, w2_bias, swiglu
    )


def fused_moe_int4(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden / 8] int32: [gate; up] rows' codes
    w2: torch.Tensor,  # [num_experts, hidden, inter / 8] int32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int (-1: another rank's expert)
    w13_scale: torch.Tensor,  # [E, 2 * inter, hidden / group] fp32
    w2_scale: torch.Tensor,  # [E, hidden, inter / group] fp32
    w13_zero: torch.Tensor,  # as w13_scale, in code units
    w2_zero: torch.Tensor,  # as w2_scale
) -> torch.Tensor:  # [num_tokens, hidden]
    """W4A16 experts on the grouped GEMMs (reference.fused_moe_int4): each weight tile's codes
    dequantized in registers to x's dtype before the dot, as int4_gemm's large-M path does."""
    tiles = _tiles(topk_ids.numel(), x.device)
    int4 = ((w13_scale, w13_zero), (w2_scale, w2_zero))
    return fused_moe_tiled(x, w13, w2, topk_weights, topk_ids, None, None, tiles, int4=int4)


def fused_moe_tiled(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    tiles: tuple[int, int, int],  # (BLOCK_M, BLOCK_N, BLOCK_K)
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    int4: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    | None = None,  # INT4 experts' ((w13 scales, zeros), (w2 scales, zeros))
) -> torch.Tensor:
    """fused_moe at given tiles (tests run the GPU's under the interpreter)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    aligned = align_by_expert(topk_ids, w13.shape[0], tiles[0])
    weights = topk_weights.reshape(-1).float().contiguous()
    gate_up = torch.empty(num_pairs, w13.shape[1], dtype=x.dtype, device=x.device)
    q13, q2 = int4 if int4 is not None else (None, None)
    _grouped_gemm(x, w13, gate_up, weights, w13_scale, w13_bias, aligned, top_k, False, tiles, q13)
    hidden = silu_and_mul(gate_up) if swiglu is None else clamped_swiglu(gate_up, *swiglu)
    # fp32 rows, so the top-k sum rounds once, as the reference's.
    down = torch.empty(num_pairs, w2.shape[1], dtype=torch.float32, device=x.device)
    _grouped_gemm(hidden, w2, down, weights, w2_scale, w2_bias, aligned, 1, True, tiles, q2)
    return down.view(num_tokens, top_k, -1).sum(dim=1).to(x.dtype)
