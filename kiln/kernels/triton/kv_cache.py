"""Scatter this step's keys and values into the paged KV cache (twin of
reference.write_kv_cache)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_E4M3_MAX


@triton.jit
def _write_kv_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    FP8: tl.constexpr,  # the cache is float8 e4m3: saturate at +-FP8_MAX before the cast
    FP8_MAX: tl.constexpr,
):
    """One program per token: copies its [num_kv_heads, head_dim] key and value rows to its slot."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    # A negative slot marks a padding token (e.g. a CUDA-graph batch padded past its real size):
    # writing it would corrupt another sequence's block, so it is skipped.
    if slot >= 0:
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        key = tl.load(
            key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
            mask=mask,
        )
        value = tl.load(
            value_ptr
            + token * stride_value_token
            + heads[:, None] * stride_value_head
            + dims[None, :],
            mask=mask,
        )
        if FP8:
            key = tl.clamp(key.to(tl.float32), -FP8_MAX, FP8_MAX)
            value = tl.clamp(value.to(tl.float32), -FP8_MAX, FP8_MAX)
        # The cache is contiguous: a slot is NUM_KV_HEADS * HEAD_DIM consecutive elements.
        cache_offsets = slot * (NUM_KV_HEADS * HEAD_DIM) + heads[:, None] * HEAD_DIM + dims[None, :]
        tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Writes key[i] and value[i] to slot slot_mapping[i] of the caches (cast to the cache dtype;
    a float8 e4m3 cache saturates at +-448, see reference.to_cache_dtype).

    key/value may be strided views (e.g. slices of a fused qkv projection) as long as head_dim is
    contiguous; the caches must be contiguous.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    assert key.shape[1:] == (num_kv_heads, head_dim) and value.shape == key.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape == v_cache.shape
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    _write_kv_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        FP8_MAX=FP8_E4M3_MAX,
        num_warps=4,
    )
