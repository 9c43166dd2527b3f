"""The fused-MoE grouped GEMM's gpt-oss options against their twins under the interpreter at
tiny shapes: experts' biases (the down bias before the routing weight), the clamped SwiGLU,
float8 weights with a scale per output channel, other ranks' experts (-1, expert parallelism)
adding no bias; and the clamped SwiGLU kernel alone against transformers' GptOssExperts
activation on interleaved columns."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops

triton_moe = importlib.import_module("kiln.kernels.triton.fused_moe")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SWIGLU = (1.702, 1.5)  # a limit the random gate_up values cross, so the clamps are exercised


def _case(num_tokens: int, dtype: torch.dtype, experts: int = 4, top_k: int = 2):
    gen = torch.Generator().manual_seed(num_tokens)
    hidden, inter = 48, 40
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.4
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.4
    b13 = torch.randn(experts, 2 * inter, generator=gen)
    b2 = torch.randn(experts, hidden, generator=gen)
    ids = torch.stack([torch.randperm(3, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.softmax(torch.randn(num_tokens, top_k, generator=gen), -1)
    moved = [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]
    return moved, b13.to(DEVICE, dtype), b2.to(DEVICE, dtype)


@pytest.mark.parametrize("num_tokens", [1, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_biases_and_the_clamped_swiglu_equal_the_loop(num_tokens, dtype) -> None:
    args, b13, b2 = _case(num_tokens, dtype)
    kw = dict(w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    got = triton_moe.fused_moe(*args, **kw).float()
    want = reference.fused_moe(*args, **kw).float()
    peak = want.abs().max()
    assert peak > 0.1
    plain = reference.fused_moe(*args).float()
    assert (want - plain).abs().max() > 0.1 * peak  # the options change the function
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol * peak, rtol=0)


def test_the_gpus_prefill_tiles_take_the_options() -> None:
    args, b13, b2 = _case(21, torch.float32)
    tiles = triton_moe._PREFILL_TILES
    got = triton_moe.fused_moe_tiled(*args, None, None, tiles, b13, b2, SWIGLU)
    want = reference.fused_moe(*args, w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    torch.testing.assert_close(got, want, atol=1e-5 * want.abs().max(), rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_channel_float8_scales_equal_the_loop(dtype) -> None:
    from kiln.layers.moe import quantize_experts_fp8

    (x, w13, w2, weights, ids), b13, b2 = _case(21, dtype)
    (w13_fp8, s13), (w2_fp8, s2) = (quantize_experts_fp8(w, per_channel=True) for w in (w13, w2))
    assert s13.shape == (4, 80) and s2.shape == (4, 48)
    args = (x, w13_fp8, w2_fp8, weights, ids, s13, s2, b13, b2, SWIGLU)
    got = triton_moe.fused_moe(*args).float()
    want = reference.fused_moe(*args).float()
    peak = want.abs().max()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol * peak, rtol=0)
    exact = reference.fused_moe(x, w13, w2, weights, ids, None, None, b13, b2, SWIGLU).float()
    assert (want - exact).abs().max() < 0.1 * peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_clamped_swiglu_equals_transformers_gate(dtype) -> None:
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    gen = torch.Generator().manual_seed(0)
    interleaved = (torch.randn(7, 2 * 24, generator=gen) * 6).to(dtype)
    config = type("C", (), dict(intermediate_size=24, num_local_experts=1, hidden_size=8,
                                swiglu_alpha=1.702, swiglu_limit=7.0))()  # fmt: skip
    if not hasattr(GptOssExperts, "_apply_gate"):  # older transformers: inline in forward
        pytest.skip("this transformers' GptOssExperts has no _apply_gate")
    want = GptOssExperts(config)._apply_gate(interleaved)
    halves = torch.cat([interleaved[:, ::2], interleaved[:, 1::2]], dim=1)
    ref = reference.clamped_swiglu(halves, 1.702, 7.0)
    torch.testing.assert_close(ref, want, atol=0, rtol=0)
    got = triton_ops.clamped_swiglu(halves.to(DEVICE), 1.702, 7.0).cpu()
    tol = 1e-6 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 7, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_experts_biases_come_from_its_rank_alone(dtype) -> None:
    """Expert parallelism (gpt-oss): two ranks holding experts 0-1 and 2-3, other ranks' ids
    -1. Each adds its own experts' down bias times their routing weight and nothing for
    another's, so the two parts sum to the whole layer's output (each bias once)."""
    (x, w13, w2, weights, ids), b13, b2 = _case(21, dtype)
    kw = dict(w13_bias=b13, w2_bias=b2, swiglu=SWIGLU)
    whole = reference.fused_moe(x, w13, w2, weights, ids, **kw).float()
    parts = []
    for first in (0, 2):
        held = slice(first, first + 2)
        local = torch.where((ids >= first) & (ids < first + 2), ids - first, -1)
        args = (x, w13[held], w2[held], weights, local)
        kw = dict(w13_bias=b13[held], w2_bias=b2[held], swiglu=SWIGLU)
        got = triton_moe.fused_moe(*args, **kw).float()
        want = reference.fused_moe(*args, **kw).float()
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(got, want, atol=tol * whole.abs().max(), rtol=0)
        parts.append(got)
    tol = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(parts[0] + parts[1], whole, atol=tol * whole.abs().max(), rtol=0)
