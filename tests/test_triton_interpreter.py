"""tests/triton_interpreter.py: the interpreter's language patch once per launch is installed
(a Triton whose internals moved would lose it silently) and kernels calling helpers compute as
before, launch after launch."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from tests.triton_interpreter import install

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the interpreter runs only without a GPU"
)


def test_installed_with_this_triton():
    assert install()


@triton.jit
def _scaled(x, scale):
    return tl.maximum(x * scale, 0.0)


@triton.jit
def _kernel(x_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, _scaled(x, scale) + tl.sum(x, axis=0) * 0, mask=mask)


def test_helpers_inside_a_launch_compute_as_triton_does():
    x = torch.randn(37)
    for scale in (2.0, -1.0):  # a second launch: the first one's patches were restored
        out = torch.empty_like(x)
        _kernel[(triton.cdiv(37, 16),)](x, out, 37, scale, BLOCK=16)
        torch.testing.assert_close(out, torch.clamp(x * scale, min=0.0))
