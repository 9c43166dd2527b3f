"""Per-head q/k RMSNorm + rotary embedding + the KV-cache write, after a fused qkv projection
(twin of reference.qk_norm_rotary_write_kv; Qwen3's attention, OLMo 2's).

One program per token: each query and key head is normalised over head_dim with its own weights
(fp32 statistics, rounded to the input dtype, times the weight rounded again, as the reference),
rotated (rotate-half, fp32, rounded to the input dtype), the keys written to the token's cache
slot with the values, the queries returned. The cache is addressed by its strides (the engine's
is head-major, kiln.kernels.kv_layout).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_E4M3_MAX
from kiln.kernels.triton._int8_kv import int8_code, is_int8_cache
from kiln.kernels.triton.fp8_gemm import round_to_e4m3_grid


@triton.jit
def _to_cache(x, cache_ptr, FP8_MAX: tl.constexpr, INT8: tl.constexpr, INTERPRETED: tl.constexpr):
    """A value in the cache's element type; a float8 cache saturates at +-FP8_MAX (rounded on
    the e4m3 grid first under the interpreter, whose own float8 conversion misrounds); an int8
    cache holds codes (_int8_kv.int8_code)."""
    if INT8:
        x = int8_code(x)
    if FP8_MAX > 0:
        x = tl.clamp(x.to(tl.float32), -FP8_MAX, FP8_MAX)
        if INTERPRETED:
            x = round_to_e4m3_grid(x)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _norm_rotate_heads(
    row_ptr,  # the token's first element of these heads, head_dim apart
    weight_ptr,  # [head_dim]
    eps,
    cos,  # [BLOCK_HALF] fp32
    sin,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """(first halves, second halves, mask) of the heads, rms-normed and rotated, in the input's
    dtype: [BLOCK_H, BLOCK_HALF] each."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    src = row_ptr + heads[:, None] * (2 * HALF) + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    variance = (tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF)
    inv_rms = tl.rsqrt(variance + eps)[:, None]
    w1 = tl.load(weight_ptr + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(weight_ptr + HALF + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    n1 = ((a * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
    n2 = ((b * inv_rms).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    r1 = (n1 * cos[None, :] - n2 * sin[None, :]).to(x1.dtype)
    r2 = (n2 * cos[None, :] + n1 * sin[None, :]).to(x1.dtype)
    return r1, r2, mask


@triton.jit
def _qk_norm_rotary_write_kv_kernel(
    qkv_ptr,  # [num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim], rows stride_qkv apart
    stride_qkv,
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_positions, head_dim] fp32, contiguous
    q_norm_ptr,  # [head_dim]
    k_norm_ptr,  # [head_dim]
    eps,
    q_out_ptr,  # [num_tokens, num_heads, head_dim], contiguous
    k_cache_ptr,  # [num_blocks, block_size, NUM_KV_HEADS, head_dim], by the strides below
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64; negative: a padding token, not written
    stride_block,  # the caches' strides (elements): a block, a slot in it, a KV head
    stride_slot,
    stride_head,
    num_heads,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,  # head_dim // 2
    BLOCK_SIZE: tl.constexpr,  # the cache's
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0 for a float8 cache
    INT8: tl.constexpr,  # an int8 cache
    INTERPRETED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + cols, mask=cols < HALF, other=0.0)
    row = qkv_ptr + token * stride_qkv
    q1, q2, q_mask = _norm_rotate_heads(
        row, q_norm_ptr, eps, cos, sin, num_heads, HALF, BLOCK_H, BLOCK_HALF
    )
    heads = tl.arange(0, BLOCK_H)
    q_dst = q_out_ptr + token * num_heads * (2 * HALF) + heads[:, None] * (2 * HALF) + cols[None, :]
    tl.store(q_dst, q1, mask=q_mask)
    tl.store(q_dst + HALF, q2, mask=q_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        k_row = row + num_heads * (2 * HALF)
        k1, k2, k_mask = _norm_rotate_heads(
            k_row, k_norm_ptr, eps, cos, sin, NUM_KV_HEADS, HALF, BLOCK_KV_H, BLOCK_HALF
        )
        kv_heads = tl.arange(0, BLOCK_KV_H)
        base = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
        k_dst = k_cache_ptr + base + kv_heads[:, None] * stride_head + cols[None, :]
        tl.store(k_dst, _to_cache(k1, k_cache_ptr, FP8_MAX, INT8, INTERPRETED), mask=k_mask)
        tl.store(k_dst + HALF, _to_cache(k2, k_cache_ptr, FP8_MAX, INT8, INTERPRETED), mask=k_mask)
        dims = tl.arange(0, 2 * BLOCK_HALF)
        v_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < 2 * HALF)
        v_src = k_row + NUM_KV_HEADS * (2 * HALF) + kv_heads[:, None] * (2 * HALF) + dims[None, :]
        value = tl.load(v_src, mask=v_mask)
        v_dst = v_cache_ptr + base + kv_heads[:, None] * stride_head + dims[None, :]
        tl.store(v_dst, _to_cache(value, v_cache_ptr, FP8_MAX, INT8, INTERPRETED), mask=v_mask)


def qk_norm_rotary_write_kv(
    qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: a fused qkv projection's output
    q_norm_weight: torch.Tensor,  # [head_dim]
    k_norm_weight: torch.Tensor,  # [head_dim]
    eps: float,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: the rotated query
    """The rotated, normed query; normed, rotated keys and the values into the cache."""
    num_tokens = qkv.shape[0]
    head_dim, num_kv_heads = cos_sin_cache.shape[1], k_cache.shape[2]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    assert head_dim % 2 == 0 and k_cache.shape[3] == head_dim, "full-width rotary only"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and qkv.stride(1) == 1
    assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    if not cos_sin_cache.is_contiguous():
        cos_sin_cache = cos_sin_cache.contiguous()
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    half = head_dim // 2
    _qk_norm_rotary_write_kv_kernel[(num_tokens,)](
        qkv, qkv.stride(0), positions, cos_sin_cache, q_norm_weight, k_norm_weight, eps, query,
        k_cache, v_cache, slot_mapping, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        FP8_MAX=FP8_E4M3_MAX if k_cache.dtype == torch.float8_e4m3fn else 0.0,
        INT8=is_int8_cache(k_cache),
        INTERPRETED=qkv.device.type != "cuda",
        num_warps=4,
    )  # fmt: skip
    return query
