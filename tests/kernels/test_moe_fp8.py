"""The float8 tensor-core grouped GEMM (kiln.kernels.triton.moe_fp8) against its twin,
reference.fused_moe_fp8, under the interpreter at tiny shapes: uneven expert loads (an expert
with no tokens, one with more than a row block), widths not multiples of the tiles, per-expert
and per-channel weight scales, fp32 and fp16 activations; the GPU's tiles; and the twin near
the weight-only float8 loop (reference.fused_moe): activation quantization's noise only."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.layers.moe import quantize_experts_fp8
from tests.kernels.moe_checks import FLOAT8_TOL, HOPPER_FLOAT8_FLOOR, close_to_peak

moe_fp8 = importlib.import_module("kiln.kernels.triton.moe_fp8")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU only: the interpreter has no bf16 arithmetic of its own.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EXPERTS = 4


def _case(num_tokens: int, top_k: int, dtype: torch.dtype, per_channel: bool,
          hidden: int = 48, inter: int = 40):  # fmt: skip
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k + per_channel)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[0] *= 8  # rows of different ranges: the per-row activation scales matter
    w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(EXPERTS, hidden, inter, generator=gen) * 0.3
    (w13, s13), (w2, s2) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
    if per_channel:
        s13 = s13[:, None] * (torch.rand(EXPERTS, 2 * inter, generator=gen) + 0.5)
        s2 = s2[:, None] * (torch.rand(EXPERTS, hidden, generator=gen) + 0.5)
    # Expert 3 never chosen; expert 0 by every token (more than one 16-row block).
    ids = torch.randint(1, 3, (num_tokens, top_k), generator=gen)
    ids[:, 0] = 0
    if top_k > 1:
        ids[:, 1] = torch.randint(1, 3, (num_tokens,), generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x.to(dtype), w13, w2, weights, ids, s13, s2)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    floor = HOPPER_FLOAT8_FLOOR if DEVICE == "cuda" else 0.0
    close_to_peak(got, want, dtype, FLOAT8_TOL, floor)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (5, 2), (21, 2)])
@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_grouped_gemm_equals_its_twin(num_tokens, top_k, per_channel, dtype) -> None:
    args = _case(num_tokens, top_k, dtype, per_channel)
    got = moe_fp8.fused_moe_fp8(*args)
    assert got.dtype == dtype and got.shape == (num_tokens, 48)
    _close(got, reference.fused_moe_fp8(*args), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu(-100): -0, as torch's
@pytest.mark.parametrize("tma", [0, 1])
def test_the_gpus_tiles_equal_the_twin(tma) -> None:
    """The default tiles, by pointer loads or TMA descriptors: K a multiple of BLOCK_K (gate_up:
    the unmasked loads) and not (down: the masked or zero-filled step), N not a multiple of
    BLOCK_N (the wrapped columns; TMA's next expert's rows)."""
    args = _case(21, 2, torch.float32, True, hidden=128, inter=144)
    tiles = (*moe_fp8.DEFAULT_TILES[:5], tma)
    got = moe_fp8.fused_moe_fp8_tiled(*args, tiles)
    _close(got, reference.fused_moe_fp8(*args), torch.float32)


def test_the_twin_is_the_weight_only_loop_plus_activation_noise() -> None:
    args = _case(21, 2, torch.float32, False)
    w8a8 = reference.fused_moe_fp8(*args)
    weight_only = reference.fused_moe(*args)
    gap = (w8a8 - weight_only).abs().max()
    assert 0 < gap < 0.05 * weight_only.abs().max()


def test_unscaled_weights_are_refused() -> None:
    x, w13, w2, weights, ids, _, _ = _case(2, 1, torch.float32, False)
    with pytest.raises(ValueError, match="scales"):
        moe_fp8.fused_moe_fp8(x, w13, w2, weights, ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_captures_the_fp8_grouped_gemm() -> None:
    """No host sync: quantization, sort, GEMMs and sum captured, replayed to the eager result."""
    args = _case(21, 2, torch.bfloat16, True)
    eager = moe_fp8.fused_moe_fp8(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_fp8.fused_moe_fp8(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)


def test_prefill_sized_steps_take_the_wide_tiles() -> None:
    """The GPU's tiles by rows an expert: the wide ones from 256 routed rows an expert (their
    BLOCK_M of 128 pads fewer rows too much), the interpreter's on the CPU."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    assert moe_fp8.default_tiles(8192 * 8, 128, gpu) == moe_fp8.LARGE_TILES
    assert moe_fp8.default_tiles(256 * 128 - 1, 128, gpu) == moe_fp8.DEFAULT_TILES
    assert moe_fp8.default_tiles(16, 128, gpu) == moe_fp8.DEFAULT_TILES
    assert moe_fp8.default_tiles(8192 * 8, 128, cpu) == moe_fp8._INTERPRETER_TILES
