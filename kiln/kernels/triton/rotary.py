"""Rotate-half rotary embedding fused with the KV-cache write (twin of
reference.rotary_embedding_write_kv).

One program per token rotates all its query and key heads (cos/sin read once per token), writes
the rotated keys and the values to its cache slot, and returns the rotated queries. Math in fp32,
results rounded to the input dtype, then to the cache's (float8 saturating at +-448, int8
rounded half up and saturating at +-127, as reference.to_cache_dtype). Scaled variants
(llama3, linear, ...) differ only in the cos_sin_cache, so the kernel is the same. A table
narrower than head_dim turns each head's first dims only (partial rotary) and copies the rest:
a constexpr, compiled out at full width.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.kv_layout import check_head_major
from kiln.kernels.reference import FP8_E4M3_MAX
from kiln.kernels.triton._int8_kv import int8_code, is_int8_cache
from kiln.kernels.triton._kv_layout import kv_head_offset, kv_slot_base


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
    FP8_MAX: tl.constexpr,  # > 0: the output is a float8 cache, saturated at +-FP8_MAX
    HEAD_DIM: tl.constexpr,  # > 2 * HALF: partial rotary, dims [2 * HALF, HEAD_DIM) pass
    BLOCK_PASS: tl.constexpr,
    INT8: tl.constexpr,  # the output is an int8 cache: codes (_int8_kv.int8_code)
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
    # Rounded to the input dtype first (as reference.rotary_embedding), then to the output's.
    tl.store(dst, _to_output(out1.to(x1.dtype), out_ptr, FP8_MAX, INT8), mask=mask)
    tl.store(dst + HALF, _to_output(out2.to(x1.dtype), out_ptr, FP8_MAX, INT8), mask=mask)
    if HEAD_DIM > 2 * HALF:
        rest = tl.arange(0, BLOCK_PASS)
        rest_mask = (heads[:, None] < num_heads) & (rest[None, :] < HEAD_DIM - 2 * HALF)
        row_x = x_ptr + token * stride_x_token + heads[:, None] * stride_x_head
        row_out = out_ptr + token * stride_out_token + heads[:, None] * stride_out_head
        src_rest = row_x + 2 * HALF + rest[None, :]
        dst_rest = row_out + 2 * HALF + rest[None, :]
        passed = tl.load(src_rest, mask=rest_mask, other=0.0)
        tl.store(dst_rest, _to_output(passed, out_ptr, FP8_MAX, INT8), mask=rest_mask)


@triton.jit
def _to_output(x, out_ptr, FP8_MAX: tl.constexpr, INT8: tl.constexpr):
    if INT8:
        x = int8_code(x)
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX)
    return x.to(out_ptr.dtype.element_ty)


@triton.jit
def _rotary_write_kv_kernel(
    positions_ptr,  # [num_tokens] int64
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    q_out_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], head-major
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; negative: a padding token, not written
    cos_sin_ptr,  # [max_positions, head_dim] fp32, contiguous
    stride_q_token,
    stride_q_head,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_qo_token,
    stride_qo_head,
    num_heads,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2 (head_dim // 2 but for partial rotary)
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0 for a float8 cache
    INT8: tl.constexpr,  # an int8 cache
    BLOCK_SIZE: tl.constexpr,  # the cache's
    HEAD_DIM: tl.constexpr,  # > 2 * HALF for partial rotary
    BLOCK_PASS: tl.constexpr,  # next power of two of HEAD_DIM - 2 * HALF (1 at full width)
    BLOCK_D: tl.constexpr,  # next power of two of HEAD_DIM
):
    """One program per token: rotates its query heads (out) and key heads (into the cache at its
    slot), and copies its value heads into the cache. One launch instead of a rotary and a
    KV-write kernel: at batch-1 decode each was a ~2 us kernel of a few hundred bytes."""
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    col_mask = cols < HALF
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + cols, mask=col_mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + cols, mask=col_mask, other=0.0)
    _rotate_heads(
        q_ptr, q_out_ptr, token, stride_q_token, stride_q_head, stride_qo_token, stride_qo_head,
        cos, sin, num_heads, HALF, BLOCK_H, BLOCK_HALF, 0.0, HEAD_DIM, BLOCK_PASS, False,
    )  # fmt: skip
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        # The token's head 0 row in the cache, and the step from one head's row to the next's.
        base = kv_slot_base(slot, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE)
        head_stride = kv_head_offset(1, HEAD_DIM, BLOCK_SIZE)
        _rotate_heads(
            k_ptr, k_cache_ptr + base, token, stride_k_token, stride_k_head, 0, head_stride, cos,
            sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK_HALF, FP8_MAX, HEAD_DIM, BLOCK_PASS, INT8,
        )  # fmt: skip
        heads = tl.arange(0, BLOCK_KV_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        src = v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :]
        value = tl.load(src, mask=mask)
        dst = v_cache_ptr + base + heads[:, None] * head_stride
        tl.store(dst + dims[None, :], _to_output(value, v_cache_ptr, FP8_MAX, INT8), mask=mask)


def rotary_embedding_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # the rotated query
    """rotary_embedding(query, key), then write_kv_cache(rotated key, value): returns the rotated
    query; the inputs are left untouched (they may be strided views of a fused qkv projection,
    head_dim contiguous)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert key.shape == value.shape == (num_tokens, num_kv_heads, head_dim)
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and k_cache.shape == v_cache.shape
    check_head_major(k_cache, v_cache)
    rotary_dim = cos_sin_cache.shape[1]
    assert rotary_dim <= head_dim and rotary_dim % 2 == 0, "rotary turns pairs of a head's dims"
    query, key, value = (t if t.stride(2) == 1 else t.contiguous() for t in (query, key, value))
    if not cos_sin_cache.is_contiguous():
        cos_sin_cache = cos_sin_cache.contiguous()
    q_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return q_out
    half = rotary_dim // 2
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    # At full width the pass-through is compiled out (Llama's kernel is the same code).
    partial = dict(
        HEAD_DIM=head_dim,
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    _rotary_write_kv_kernel[(num_tokens,)](
        positions, query, key, value, q_out, k_cache, v_cache, slot_mapping, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), q_out.stride(0), q_out.stride(1),
        num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        FP8_MAX=FP8_E4M3_MAX if fp8 else 0.0,
        INT8=is_int8_cache(k_cache),
        BLOCK_SIZE=k_cache.shape[1],
        num_warps=4,
        **partial,
    )  # fmt: skip
    return q_out
