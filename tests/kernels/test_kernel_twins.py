"""The house rule for kernels: every Triton kernel has a pure-PyTorch twin in
kiln.kernels.reference with the same signature, so either module serves as the `ops` module."""

from __future__ import annotations

import inspect
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops


@pytest.mark.parametrize("name", triton_ops.__all__)
def test_every_triton_kernel_has_a_reference_twin_with_its_signature(name: str) -> None:
    # Fails when a kernel is exported without a twin, or when the two differ in a parameter's
    # name, order, kind, default or (string, under `from __future__ import annotations`)
    # annotation, or in the return annotation.
    assert hasattr(reference, name), f"kiln.kernels.reference has no twin of {name}"
    assert inspect.signature(getattr(reference, name)) == inspect.signature(
        getattr(triton_ops, name)
    )
