"""Rotate-half rotary embedding (twin of reference.rotary_embedding).

One program per token rotates all its query and key heads: cos/sin are read once per token. Math in
fp32, results rounded to the input dtype. Scaled variants (llama3, linear, ...) differ only in the
cos_sin_cache, so the kernel is the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr,
    out_ptr,
    token,
    stride_x_token,
    stride_x_head,
    stride_out_token,
    stride_out_head,
    cos,  # [BLOCK_HALF] fp32
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    src = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    out1 = x1f * cos[None, :] - x2f * sin[None, :]
    out2 = x2f * cos[None, :] + x1f * sin[None, :]
    dst = out_ptr + token * stride_out_token + heads[:, None] * stride_out_head + cols[None, :]
    tl.store(dst, out1.to(x1.dtype), mask=mask)
    tl.store(dst + HALF, out2.to(x1.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,
    k_out_ptr,
    cos_sin_ptr,  # [max_positions, head_dim] fp32, contiguous
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_qo_token,
    stride_qo_head,
    stride_ko_token,
    stride_ko_head,
    num_heads,
    num_kv_heads,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + cols, mask=col_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + cols, mask=col_mask, other=0.0)
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
        cos, sin, num_heads, HALF, BLOCK_H, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        k_ptr, k_out_ptr, token, stride_k_token, stride_k_head, stride_ko_token, stride_ko_head,
        cos, sin, num_kv_heads, HALF, BLOCK_KV_H, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32: cos in the first half, sin after
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX / Hugging Face Llama layout) rotary embedding, computed in fp32.

    Returns new (query, key) tensors; the inputs (which may be strided views of a fused qkv
    projection, head_dim contiguous) are left untouched.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == (num_tokens, num_kv_heads, head_dim)
    assert cos_sin_cache.shape[1] == head_dim and head_dim % 2 == 0, "full-width rotary only"
    if query.stride(2) != 1:
        query = query.contiguous()
    if key.stride(2) != 1:
        key = key.contiguous()
    if not cos_sin_cache.is_contiguous():
        cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    k_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions,
        query,
        key,
        q_out,
        k_out,
        cos_sin_cache,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        num_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4,
    )
    return q_out, k_out
