"""The paged KV cache's two block layouts.

A cache is always indexed [num_blocks, block_size, num_kv_heads, head_dim]. Token-major (a
contiguous tensor; KILN_KV_CACHE_LAYOUT=token) keeps a token's heads together: one KV head's
keys of a block are rows of head_dim elements num_kv_heads * head_dim apart. Head-major (the
default: a transposed view of [num_blocks, num_kv_heads, block_size, head_dim] memory) keeps a
head's keys of a block together, as TensorRT-LLM's and FlashInfer's paged caches do: a decode
program reading one KV head then reads block_size * head_dim contiguous elements a block instead
of block_size rows spread over it. Measured on an H100 (docs/performance.md): float8 decode
attention faster a layer at every shape swept (median 5.4%), 1000/1000 +2.6-3.0% end to end,
batch 1, 128/128 and 2048/128 unchanged; the CPU path alike. Every kernel (Triton and the
torch reference) reads and writes both. Each block's bytes stay together in both, so block
copies move whole blocks either way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.envs import envs


def head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the caches lie head-major in memory (see the module's docstring); a cache of
    neither layout, or K and V in different ones, is an error."""
    layouts = []
    for cache in (k_cache, v_cache):
        if cache.is_contiguous():
            layouts.append(False)
        elif cache.transpose(1, 2).is_contiguous():
            layouts.append(True)
        else:
            raise ValueError(
                f"a KV cache must be token- or head-major, got strides {cache.stride()}"
            )
    if layouts[0] != layouts[1]:
        raise ValueError("the K and V caches must share one layout")
    return layouts[0]


def empty_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device, head_major_layout: bool,
    allocate: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """A [num_blocks, block_size, num_kv_heads, head_dim] cache in the given layout; `allocate`
    makes the memory from a shape, dtype and device (zeroed)."""
    if not head_major_layout:
        return allocate((num_blocks, block_size, num_kv_heads, head_dim), dtype, device)
    return allocate((num_blocks, num_kv_heads, block_size, head_dim), dtype, device).transpose(1, 2)


def kv_cache_head_major() -> bool:
    """Whether the engine allocates head-major caches (KILN_KV_CACHE_LAYOUT)."""
    layout = envs().kv_cache_layout
    if layout not in ("token", "head"):
        raise ValueError(f"KILN_KV_CACHE_LAYOUT={layout!r}: expected 'token' or 'head'")
    return layout == "head"
