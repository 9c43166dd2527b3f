"""Small host-side helpers shared by the kernel launchers."""

from __future__ import annotations

import functools

import torch


@functools.cache
def _cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of the device (cached: no query per launch)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _cuda_num_sms(index)
    return 132  # the interpreter: pretend to be an H200 so launch policies run the same way


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: exact fp32 products for fp32 inputs (tf32 would lose ~1e-3);
    ignored for fp16/bf16."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fp16_dots(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether attention over a float8 cache should widen K/V to fp16 rather than to the bf16
    query's dtype: float8 -> fp16 is one instruction per two values, float8 -> bf16 goes through
    fp32 (H200 decode over float8: 2.1 TB/s widened to bf16, 2.3 to fp16; the V operand's own
    limit is handled in _fp8.py). The query (|q| far below fp16's 65504) and the softmax weights
    (in [0, 1]) lose nothing in fp16, which has more mantissa than bf16; products still
    accumulate in fp32."""
    return k_cache.dtype == torch.float8_e4m3fn and query.dtype == torch.bfloat16


def output_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """An attention kernel's output: `out` when the caller gives one (a slice of a larger
    tensor; head_dim contiguous, as the kernels store it), else a new tensor shaped like the
    query."""
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    assert out.shape == query.shape and out.dtype == query.dtype and out.stride(2) == 1
    return out


def unit_stride_rows(
    query: torch.Tensor, block_tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query's head_dim and the block table's columns at stride 1 (copied only where not),
    as the attention kernels index them."""
    if query.stride(2) != 1:
        query = query.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    return query, block_tables
