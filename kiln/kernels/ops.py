"""Picks the kernel implementation for a device: Triton on CUDA (when importable), else the
pure-PyTorch reference. Both expose the same functions with the same signatures."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch


def kernel_ops(device: torch.device, prefer_triton: bool = True) -> ModuleType:
    if prefer_triton and device.type == "cuda" and importlib.util.find_spec("triton"):
        from kiln.kernels import triton as triton_ops

        return triton_ops
    from kiln.kernels import reference

    return reference
