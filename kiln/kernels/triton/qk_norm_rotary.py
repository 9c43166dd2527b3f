"""Per-head q/k RMSNorm + rotary embedding + the KV-cache write, after a fused qkv projection
(twin of reference.qk_norm_rotary_write_kv; Qwen3's attention), or its LayerNorm flavour
(`layer_norm`: Cohere's use_qk_norm, StableLM 2 12B's qk_layernorm, a weight row per head).

One program per token: each query and key head is normalised over head_dim with its weights
(fp32 statistics, rounded to the input dtype, times the weight rounded again, as the reference;
the LayerNorm flavour centres the head and rounds once, as reference.head_layer_norm),
rotated (rotate-half, fp32, rounded to the input dtype; a table narrower than head_dim turns the
first dims and passes the rest, StableLM's partial rotary), the keys written to the token's cache
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
    row_ptr,  # the token's first element of these heads, HEAD_DIM apart
    weight_ptr,  # [head_dim], or [heads, head_dim] (w_head_stride apart)
    w_head_stride,  # 0: one weight row shared by the heads
    eps,
    cos,  # [BLOCK_HALF] fp32
    sin,
    num_heads,
    HALF: tl.constexpr,  # rotary_dim // 2
    HEAD_DIM: tl.constexpr,  # > 2 * HALF: partial rotary, dims [2 * HALF, HEAD_DIM) pass
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    LAYER_NORM: tl.constexpr,  # reference.head_layer_norm instead of rms_norm
):
    """(first halves, second halves, their mask, the passed dims, their mask) of the heads,
    normed over HEAD_DIM and the rotary dims rotated, in the input's dtype: [BLOCK_H,
    BLOCK_HALF] each, the passed dims [BLOCK_H, BLOCK_PASS]."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (cols[None, :] < HALF)
    head_row = row_ptr + heads[:, None] * HEAD_DIM
    src = head_row + cols[None, :]
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    w_rows = weight_ptr + heads[:, None] * w_head_stride
    w1 = tl.load(w_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w2 = tl.load(w_rows + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rest = tl.arange(0, BLOCK_PASS)
    rest_mask = (heads[:, None] < num_heads) & (rest[None, :] < HEAD_DIM - 2 * HALF)
    c = tl.zeros([BLOCK_H, BLOCK_PASS], dtype=tl.float32)
    wc = tl.zeros([BLOCK_H, BLOCK_PASS], dtype=tl.float32)
    if HEAD_DIM > 2 * HALF:
        c = tl.load(head_row + 2 * HALF + rest[None, :], mask=rest_mask, other=0.0)
        c = c.to(tl.float32)
        wc = tl.load(w_rows + 2 * HALF + rest[None, :], mask=rest_mask, other=0.0)
        wc = wc.to(tl.float32)
    if LAYER_NORM:
        # fp32 statistics of the centred head, times its weights, rounded once.
        total = tl.sum(a, 1) + tl.sum(b, 1) + tl.sum(c, 1)
        mean = (total / HEAD_DIM)[:, None]
        a = tl.where(mask, a - mean, 0.0)
        b = tl.where(mask, b - mean, 0.0)
        c = tl.where(rest_mask, c - mean, 0.0)
        variance = (tl.sum(a * a, 1) + tl.sum(b * b, 1) + tl.sum(c * c, 1)) / HEAD_DIM
        inv_std = tl.rsqrt(variance + eps)[:, None]
        n1 = (a * inv_std * w1).to(x1.dtype).to(tl.float32)
        n2 = (b * inv_std * w2).to(x1.dtype).to(tl.float32)
        nc = (c * inv_std * wc).to(x1.dtype)
    else:
        variance = (tl.sum(a * a, 1) + tl.sum(b * b, 1) + tl.sum(c * c, 1)) / HEAD_DIM
        inv_rms = tl.rsqrt(variance + eps)[:, None]
        n1 = ((a * inv_rms).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        n2 = ((b * inv_rms).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
        nc = ((c * inv_rms).to(x1.dtype).to(tl.float32) * wc).to(x1.dtype)
    r1 = (n1 * cos[None, :] - n2 * sin[None, :]).to(x1.dtype)
    r2 = (n2 * cos[None, :] + n1 * sin[None, :]).to(x1.dtype)
    return r1, r2, mask, nc, rest_mask


@triton.jit
def _qk_norm_rotary_write_kv_kernel(
    qkv_ptr,  # [num_tokens, (num_heads + 2 * NUM_KV_HEADS) * head_dim], rows stride_qkv apart
    stride_qkv,
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_positions, rotary_dim] fp32, contiguous
    q_norm_ptr,  # [head_dim], or [num_heads, head_dim]
    k_norm_ptr,  # [head_dim], or [NUM_KV_HEADS, head_dim]
    q_w_head_stride,  # 0 for one weight row shared by the heads, else head_dim
    k_w_head_stride,
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
    HALF: tl.constexpr,  # rotary_dim // 2
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's
    BLOCK_H: tl.constexpr,
    BLOCK_KV_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,  # next power of two of HEAD_DIM - 2 * HALF (1 at full width)
    BLOCK_D: tl.constexpr,  # next power of two of HEAD_DIM
    FP8_MAX: tl.constexpr,  # > 0 for a float8 cache
    INT8: tl.constexpr,  # an int8 cache
    INTERPRETED: tl.constexpr,
    LAYER_NORM: tl.constexpr = False,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_sin_ptr + position * (2 * HALF) + cols, mask=cols < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + position * (2 * HALF) + HALF + cols, mask=cols < HALF, other=0.0)
    rest = tl.arange(0, BLOCK_PASS)
    row = qkv_ptr + token * stride_qkv
    q1, q2, q_mask, q_rest, q_rest_mask = _norm_rotate_heads(
        row, q_norm_ptr, q_w_head_stride, eps, cos, sin, num_heads, HALF, HEAD_DIM, BLOCK_H,
        BLOCK_HALF, BLOCK_PASS, LAYER_NORM,
    )  # fmt: skip
    heads = tl.arange(0, BLOCK_H)
    q_head = q_out_ptr + token * num_heads * HEAD_DIM + heads[:, None] * HEAD_DIM
    tl.store(q_head + cols[None, :], q1, mask=q_mask)
    tl.store(q_head + HALF + cols[None, :], q2, mask=q_mask)
    if HEAD_DIM > 2 * HALF:
        tl.store(q_head + 2 * HALF + rest[None, :], q_rest, mask=q_rest_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        k_row = row + num_heads * HEAD_DIM
        k1, k2, k_mask, k_rest, k_rest_mask = _norm_rotate_heads(
            k_row, k_norm_ptr, k_w_head_stride, eps, cos, sin, NUM_KV_HEADS, HALF, HEAD_DIM,
            BLOCK_KV_H, BLOCK_HALF, BLOCK_PASS, LAYER_NORM,
        )  # fmt: skip
        kv_heads = tl.arange(0, BLOCK_KV_H)
        base = (slot // BLOCK_SIZE) * stride_block + (slot % BLOCK_SIZE) * stride_slot
        k_head = k_cache_ptr + base + kv_heads[:, None] * stride_head
        k_dst = k_head + cols[None, :]
        tl.store(k_dst, _to_cache(k1, k_cache_ptr, FP8_MAX, INT8, INTERPRETED), mask=k_mask)
        tl.store(k_dst + HALF, _to_cache(k2, k_cache_ptr, FP8_MAX, INT8, INTERPRETED), mask=k_mask)
        if HEAD_DIM > 2 * HALF:
            tl.store(k_head + 2 * HALF + rest[None, :],
                     _to_cache(k_rest, k_cache_ptr, FP8_MAX, INT8, INTERPRETED),
                     mask=k_rest_mask)  # fmt: skip
        dims = tl.arange(0, BLOCK_D)
        v_mask = (kv_heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        v_src = k_row + NUM_KV_HEADS * HEAD_DIM + kv_heads[:, None] * HEAD_DIM + dims[None, :]
        value = tl.load(v_src, mask=v_mask)
        v_dst = v_cache_ptr + base + kv_heads[:, None] * stride_head + dims[None, :]
        tl.store(v_dst, _to_cache(value, v_cache_ptr, FP8_MAX, INT8, INTERPRETED), mask=v_mask)


def qk_norm_rotary_write_kv(
    qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: a fused qkv projection's output
    q_norm_weight: torch.Tensor,  # [head_dim], or [num_heads, head_dim]: a row per head
    k_norm_weight: torch.Tensor,  # [head_dim], or [num_kv_heads, head_dim]
    eps: float,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    layer_norm: bool = False,  # each head LayerNormed (reference.head_layer_norm)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: the rotated query
    """The rotated, normed query; normed, rotated keys and the values into the cache."""
    num_tokens = qkv.shape[0]
    head_dim, num_kv_heads = k_cache.shape[3], k_cache.shape[2]
    rotary_dim = cos_sin_cache.shape[1]
    num_heads = qkv.shape[1] // head_dim - 2 * num_kv_heads
    assert rotary_dim <= head_dim and rotary_dim % 2 == 0, "rotary turns pairs of a head's dims"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and qkv.stride(1) == 1
    assert q_norm_weight.is_contiguous() and k_norm_weight.is_contiguous()
    assert q_norm_weight.shape in ((head_dim,), (num_heads, head_dim))
    assert k_norm_weight.shape in ((head_dim,), (num_kv_heads, head_dim))
    if not cos_sin_cache.is_contiguous():
        cos_sin_cache = cos_sin_cache.contiguous()
    query = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return query
    half = rotary_dim // 2
    # The flavour is passed only when set: Qwen3's launch compiles as before.
    flavour = {"LAYER_NORM": True} if layer_norm else {}
    _qk_norm_rotary_write_kv_kernel[(num_tokens,)](
        qkv, qkv.stride(0), positions, cos_sin_cache, q_norm_weight, k_norm_weight,
        head_dim if q_norm_weight.dim() == 2 else 0, head_dim if k_norm_weight.dim() == 2 else 0,
        eps, query, k_cache, v_cache, slot_mapping,
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HALF=half,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(head_dim - rotary_dim, 1)),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8_MAX=FP8_E4M3_MAX if k_cache.dtype == torch.float8_e4m3fn else 0.0,
        INT8=is_int8_cache(k_cache),
        INTERPRETED=qkv.device.type != "cuda",
        num_warps=4,
        **flavour,
    )  # fmt: skip
    return query
