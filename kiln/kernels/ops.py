"""The one place that decides "Triton or torch": every kernel the model, the sampler and the
attention backend run comes from the module this picks, so `attention_backend="torch"` on CUDA
runs the pure-PyTorch reference everywhere (norms and linears too), not only in attention."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

KERNEL_BACKENDS = ("torch", "triton")


def resolve_kernel_backend(name: str, device: torch.device) -> str:
    """ "auto" is Triton on CUDA when triton imports, else the reference ("torch")."""
    if name == "auto":
        on_gpu = device.type == "cuda" and importlib.util.find_spec("triton") is not None
        return "triton" if on_gpu else "torch"
    if name not in KERNEL_BACKENDS:
        raise ValueError(
            f"unknown kernel backend {name!r}; known: {', '.join(KERNEL_BACKENDS)}, auto"
        )
    return name


def kernel_ops(backend: str) -> ModuleType:
    """The kernel module of a resolved backend; both expose the same functions and signatures."""
    if backend == "triton":
        from kiln.kernels import triton as triton_ops

        return triton_ops
    from kiln.kernels import reference

    return reference
