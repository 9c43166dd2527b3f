"""How the MoE grouped GEMMs (fused_moe.py, moe_fp8.py, moe_fp8_block.py) read and write the
expert-sorted pair list of fused_moe.align_by_expert: each program's row block and column tile,
and the store of its rows back at their pairs' places (shared, so the three agree on the
layout)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def sorted_tile(sorted_pairs_ptr, block_experts_ptr, num_pairs, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr):  # fmt: skip
    """The program's tile: (pairs [BLOCK_M]: each row's flat (token * top_k + k) pair index,
    num_pairs for padding; valid [BLOCK_M]: the rows of a pair; expert: the row block's expert,
    int64; cols [BLOCK_N]: the output columns). The caller returns first for the blocks past
    the padded list's real end."""
    pid_m = tl.program_id(0)
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    expert = tl.load(block_experts_ptr + pid_m).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return pairs, pairs < num_pairs, expert, cols


@triton.jit
def store_pair_rows(out_ptr, stride_out, acc, pairs, valid, cols, N, weights_ptr,
                    MUL_WEIGHT: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] fp32 into out's rows `pairs` in out's dtype, each row first
    scaled by its pair's routing weight with MUL_WEIGHT; padding rows and columns past N are
    not stored."""
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pairs, mask=valid, other=0.0)[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))
