"""An int8 KV cache's codes in the cache-writing kernels (twin: reference.to_cache_dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import INT8_KV_MAX

_INT8_MAX = tl.constexpr(INT8_KV_MAX)


def is_int8_cache(cache: torch.Tensor) -> bool:
    """Whether keys and values go into this cache as int8 codes (the kernels' INT8 flag)."""
    return cache.dtype == torch.int8


@triton.jit
def int8_code(x):
    """floor(x + 0.5) in fp32, saturated at +-127: the reference's rounding, op for op (a
    float-to-int conversion alone would truncate toward zero)."""
    return tl.clamp(tl.floor(x.to(tl.float32) + 0.5), -_INT8_MAX, _INT8_MAX)
