"""Small host-side helpers shared by the kernel launchers."""

from __future__ import annotations

import functools
import os

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


@functools.cache
def _pdl_supported(device_index: int) -> bool:
    import triton
    import triton.language.extra.cuda as tl_cuda

    options = getattr(getattr(triton.backends, "nvidia", None), "compiler", None)
    fields = getattr(getattr(options, "CUDAOptions", None), "__dataclass_fields__", {})
    return (
        torch.cuda.get_device_capability(device_index)[0] >= 9
        and hasattr(tl_cuda, "gdc_wait")
        and "launch_pdl" in fields
    )


def use_pdl(device: torch.device) -> bool:
    """Programmatic dependent launch (Hopper and later, Triton >= 3.4): a kernel launched with it
    is scheduled while the kernel before it still runs, and waits (griddepcontrol.wait) only
    before touching memory. Batch-1 decode is ~270 kernels of a few microseconds each, so the
    launch latency it hides is a large share of the step. KILN_PDL=0 turns it off (A/B)."""
    if device.type != "cuda" or os.environ.get("KILN_PDL", "1") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _pdl_supported(index)


def pdl_launch_options(device: torch.device) -> dict:
    """Keyword arguments for a kernel launch: USE_PDL (the kernel's constexpr) and, when on,
    launch_pdl=True."""
    pdl = use_pdl(device)
    return {"USE_PDL": pdl, "launch_pdl": True} if pdl else {"USE_PDL": False}
