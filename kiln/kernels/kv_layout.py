"""Where a paged KV cache keeps each block's values: the one place that decides it.

Keys are always [num_blocks, block_size, num_kv_heads, head_dim], contiguous. Values are too,
except in a float8 cache, whose V is stored transposed per block: each block holds, per KV head,
[head_dim, block_size] (a token's values are `block_size` bytes apart). Decode attention's P @ V
needs V with the key dimension contiguous for the tensor cores, and 8-bit operands cannot be
transposed on the way there (ldmatrix transposes 16-bit elements only): stored the usual way,
float8 V streamed at ~2.4 TB/s on an H200 where K, and bf16 V, stream at ~4.3 TB/s
(docs/performance.md, "FP8 KV cache"). Stored transposed, V takes K's plain pipelined load path.

Either way a V cache is handed around as the same logical [num_blocks, block_size, num_kv_heads,
head_dim] tensor: the transposed one is a permuted view (strides (block, 1, head_dim * block_size,
block_size)) of its [num_blocks, num_kv_heads, head_dim, block_size] storage, so `v[b, t, h, d]`
is the same value in both and the pure-PyTorch twins index it unchanged. The kernels read the
layout from the strides (v_is_transposed), and each block still occupies one contiguous range of
memory, so whole-block copies (copy-on-write forks) copy bytes as before.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.envs import envs

Allocator = Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def transposes_v(dtype: torch.dtype) -> bool:
    """Whether a cache of this element type stores V transposed per block (float8 only, unless
    KILN_FP8_V_TRANSPOSED=0: the A/B against the old layout)."""
    return dtype == torch.float8_e4m3fn and envs().fp8_v_transposed


def allocate_kv_cache(
    shape: tuple[int, int, int, int],  # (num_blocks, block_size, num_kv_heads, head_dim)
    dtype: torch.dtype,
    device: torch.device,
    alloc: Allocator = _zeros,  # must zero: stale slots of a fresh cache are read (and masked)
    transpose_v: bool | None = None,  # None: transposes_v(dtype)
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_cache, v_cache), V in the layout its dtype takes."""
    if transpose_v is None:
        transpose_v = transposes_v(dtype)
    k_cache = alloc(shape, dtype, device)
    if not transpose_v:
        return k_cache, alloc(shape, dtype, device)
    num_blocks, block_size, num_kv_heads, head_dim = shape
    storage = alloc((num_blocks, num_kv_heads, head_dim, block_size), dtype, device)
    return k_cache, storage.permute(0, 3, 1, 2)


def transposed_v_strides(shape: torch.Size | tuple[int, ...]) -> tuple[int, int, int, int]:
    _, block_size, num_kv_heads, head_dim = shape
    return (num_kv_heads * head_dim * block_size, 1, head_dim * block_size, block_size)


def v_is_transposed(v_cache: torch.Tensor) -> bool:
    """True for a V cache in the transposed layout, False for a contiguous one; anything else
    is a ValueError. (With block_size 1 the two are the same memory: contiguous.)"""
    if v_cache.is_contiguous():
        return False
    if v_cache.dim() == 4 and v_cache.stride() == transposed_v_strides(v_cache.shape):
        return True
    raise ValueError(
        f"a V cache must be contiguous or kv_layout's transposed view, got shape "
        f"{tuple(v_cache.shape)} strides {v_cache.stride()}"
    )


def blocks_are_dense(cache: torch.Tensor) -> bool:
    """Each block one contiguous range, block after block (both layouts): what whole-block byte
    copies need."""
    return cache.is_contiguous() or (
        cache.dim() == 4 and cache.stride() == transposed_v_strides(cache.shape)
    )
