"""Element offsets in a paged KV cache's head-major blocks (kiln.kernels.kv_layout), for the
kernels that read or write it: a block is [num_kv_heads, block_size, head_dim] in memory."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_head_offset(kv_head, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """Where a KV head's block_size rows start within a block (elements)."""
    return kv_head * (BLOCK_SIZE * HEAD_DIM)


@triton.jit
def kv_tile_offsets(
    block_ids, in_block, head_offset, dims,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    """Element offsets [N, len(dims)] of N keys of one KV head (head_offset from
    kv_head_offset), from their blocks' ids (int64) and places in those blocks."""
    rows = block_ids * (NUM_KV_HEADS * BLOCK_SIZE) + in_block
    return rows[:, None] * HEAD_DIM + head_offset + dims[None, :]


@triton.jit
def kv_slot_base(
    slot, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """Element offset of KV head 0's row of the token at `slot` (int64); head h's row is
    kv_head_offset(h) past it."""
    return (slot // BLOCK_SIZE) * (NUM_KV_HEADS * BLOCK_SIZE * HEAD_DIM) + (
        slot % BLOCK_SIZE
    ) * HEAD_DIM
