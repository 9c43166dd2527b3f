"""The paged KV cache's block layout: head-major.

A cache is indexed [num_blocks, block_size, num_kv_heads, head_dim], a transposed view of
[num_blocks, num_kv_heads, block_size, head_dim] memory: a head's keys of a block lie together,
as in TensorRT-LLM's and FlashInfer's paged caches, so a decode program reading one KV head reads
block_size * head_dim contiguous elements a block (float8 decode attention ~5% faster a layer on
an H100 than with a token's heads together). Each block's bytes stay together, so block copies
move whole blocks. The Triton kernels take this layout only (check_head_major); the torch
reference indexes the view, whatever lies beneath it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def is_head_major(cache: torch.Tensor) -> bool:
    """Whether a [num_blocks, block_size, num_kv_heads, head_dim] cache lies head-major."""
    return cache.dim() == 4 and cache.transpose(1, 2).is_contiguous()


def check_head_major(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Raises unless both caches lie head-major (empty_cache makes them so)."""
    for cache in (k_cache, v_cache):
        if not is_head_major(cache):
            raise ValueError(
                "a KV cache must be head-major (kiln.kernels.kv_layout.empty_cache), got shape "
                f"{tuple(cache.shape)} with strides {cache.stride()}"
            )


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def empty_cache(
    num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    device: torch.device,
    allocate: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = _zeros,
) -> torch.Tensor:  # fmt: skip
    """A head-major [num_blocks, block_size, num_kv_heads, head_dim] cache; `allocate` makes the
    memory from a shape, dtype and device (default: torch.zeros)."""
    return allocate((num_blocks, num_kv_heads, block_size, head_dim), dtype, device).transpose(1, 2)


def empty_layer_cache(
    shape: tuple[int, int, int, int],  # [num_blocks, block_size, num_kv_heads, head_dim]
    dtype: torch.dtype,
    device: torch.device,
    allocate: Callable[[tuple[int, ...], torch.dtype, torch.device], torch.Tensor] = _zeros,
    tensors: int = 2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's (k_cache, v_cache); with `tensors=1` one tensor is both (multi-head latent
    attention: its values are columns of the rows its keys are, kiln.models.mla)."""
    k_cache = empty_cache(*shape, dtype, device, allocate)
    return (k_cache, k_cache) if tensors == 1 else (k_cache, empty_cache(*shape, dtype, device,
                                                                         allocate))  # fmt: skip
