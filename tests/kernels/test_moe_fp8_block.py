"""The block-scaled float8 experts' kernels against their twins under the interpreter at tiny
shapes: the grouped GEMM (kiln.kernels.triton.moe_fp8_block vs reference.fused_moe_fp8_block)
with widths that end in a partial 128-block, uneven expert loads, another rank's ids (-1), fp32
and fp16; the decode GEMVs (moe_decode) reading 3-D block scales vs reference.fused_moe_decode
(and the routed ones vs reference.fused_moe_decode_routed); and the twins near the experts
dequantized in fp32 (activation quantization's noise only)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.layers.moe_fp8_block import quantize_experts_fp8_block
from tests.kernels.moe_checks import FLOAT8_TOL, HOPPER_FLOAT8_FLOOR, close_to_peak

moe_fp8_block = importlib.import_module("kiln.kernels.triton.moe_fp8_block")
moe_decode = importlib.import_module("kiln.kernels.triton.moe_decode")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
EXPERTS, HIDDEN, INTER = 4, 200, 136  # 2 input blocks each, the second partial


def _case(num_tokens: int, top_k: int, dtype: torch.dtype, remote: bool = False,
          hidden: int = HIDDEN, inter: int = INTER):  # fmt: skip
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    x = torch.randn(num_tokens, hidden, generator=gen)
    x[0, :100] *= 8  # groups of different ranges: the per-group activation scales matter
    w13 = torch.randn(EXPERTS, 2 * inter, hidden, generator=gen) * 0.3
    w2 = torch.randn(EXPERTS, hidden, inter, generator=gen) * 0.3
    w13[:, :128] *= 4  # blocks of different ranges: the block scales matter
    w13[:, :, 128:] *= 2
    w2[:, :, : inter // 2] *= 4
    (w13, s13), (w2, s2) = quantize_experts_fp8_block(w13), quantize_experts_fp8_block(w2)
    ids = torch.randint(1, 3, (num_tokens, top_k), generator=gen)
    ids[:, 0] = 0  # expert 0 by every token (more than one row block), expert 3 by none
    if remote:
        ids[::3, -1] = -1  # another rank's expert
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x.to(dtype), w13, w2, weights, ids, s13, s2)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    floor = HOPPER_FLOAT8_FLOOR if DEVICE == "cuda" else 0.0
    close_to_peak(got, want, dtype, FLOAT8_TOL, floor)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu(-100): -0
@pytest.mark.parametrize("num_tokens,top_k,remote", [(1, 1, False), (21, 2, False), (9, 2, True)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_block_grouped_gemm_equals_its_twin(num_tokens, top_k, remote, dtype) -> None:
    args = _case(num_tokens, top_k, dtype, remote)
    got = moe_fp8_block.fused_moe_fp8_block(*args)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    _close(got, reference.fused_moe_fp8_block(*args), dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
def test_the_gpus_tiles_equal_the_twin() -> None:
    args = _case(21, 2, torch.float32)
    for tiles in (moe_fp8_block._DECODE_TILES, moe_fp8_block._PREFILL_TILES):
        got = moe_fp8_block.fused_moe_fp8_block_tiled(*args, tiles)
        _close(got, reference.fused_moe_fp8_block(*args), torch.float32)


# The interpreter's 16-wide K steps, each inside one 128-block, and (split down GEMV) 256-wide
# ones that span two blocks, as the GPU's 512-byte steps do. hidden 136 and inter 72: partial
# blocks, at a fraction of the grouped tests' interpreted cost.
DECODE_TILES = [(8, 16, 4, 8, 16, 4, 1, 1), (32, 256, 4, 32, 256, 4, 1, 0)]


@pytest.mark.parametrize("num_tokens,dtype", [(1, torch.float32), (5, torch.float16)])
def test_decode_reads_block_scales_as_its_twin(num_tokens, dtype) -> None:
    args = _case(num_tokens, 2, dtype, hidden=136, inter=72)
    want = reference.fused_moe_decode(*args)
    for tiles in DECODE_TILES:
        _close(moe_decode.fused_moe_decode_tiled(*args, tiles), want, dtype)


@pytest.mark.parametrize("num_tokens,dtype", [(1, torch.float32), (3, torch.float16)])
def test_routed_decode_reads_block_scales_as_its_twin(num_tokens, dtype) -> None:
    """fused_moe_decode_routed (norm and routing inside the gate_up launch) on block-scaled
    experts, with a shared expert's gated output: the block scales compose with the norm."""
    x, w13, w2, _, _, s13, s2 = _case(num_tokens, 2, dtype, hidden=136, inter=72)
    gen = torch.Generator().manual_seed(num_tokens)
    norm = (torch.rand(136, generator=gen) + 0.5).to(dtype).to(DEVICE)
    logits = (torch.randn(num_tokens, EXPERTS, generator=gen) * 2).to(dtype).to(DEVICE)
    shared = (torch.randn(num_tokens, 136, generator=gen).to(dtype).to(DEVICE),
              torch.randn(num_tokens, 1, generator=gen).to(dtype).to(DEVICE))  # fmt: skip
    args = (x, norm, 1e-5, logits, 2, True, w13, w2, s13, s2, None, None, None, shared)
    want = reference.fused_moe_decode_routed(*args)
    _close(moe_decode.fused_moe_decode_routed(*args), want, dtype)
    per_expert = (s13.mean((1, 2)), s2.mean((1, 2)))  # the block scales' layout matters
    unscaled = reference.fused_moe_decode_routed(*args[:8], *per_expert, *args[10:])
    assert (want.float() - unscaled.float()).abs().max() > 0.1 * want.float().abs().max()


def _dequantized_loop(args) -> torch.Tensor:
    x, w13, w2, weights, ids, s13, s2 = args
    w13f = reference.dequantize_block_rows(w13, s13)
    w2f = reference.dequantize_block_rows(w2, s2)
    return reference.fused_moe(x, w13f, w2f, weights, ids)


def test_the_twins_are_the_dequantized_experts_plus_activation_noise() -> None:
    args = _case(21, 2, torch.float32)
    exact = _dequantized_loop(args)
    gap = (reference.fused_moe_fp8_block(*args) - exact).abs().max()
    assert 0 < gap < 0.05 * exact.abs().max()  # float8 activations per group: noise only
    decode = reference.fused_moe_decode(*args)  # weight-only: the dequantized experts
    torch.testing.assert_close(decode, exact, atol=1e-4 * exact.abs().max(), rtol=0)


def test_block_quantization_is_per_128x128_block() -> None:
    w = torch.randn(1, 200, 136)
    w[0, 130:, :5] = 100.0  # one block's range
    codes, scales = quantize_experts_fp8_block(w)
    assert scales.shape == (1, 200, 2)
    assert torch.allclose(scales[0, 128:, 0], torch.tensor(100.0 / 448))
    assert torch.all(scales[0, :128, 0] < 1) and torch.all(scales[0, 128:, 1] < 1)
    widened = reference.dequantize_block_rows(codes, scales)
    assert (widened - w).abs().max() <= 100.0 / 448 * 16  # e4m3's step at 448: 32 codes apart


def test_unscaled_or_per_expert_weights_are_refused() -> None:
    x, w13, w2, weights, ids, s13, s2 = _case(2, 1, torch.float32)
    with pytest.raises(ValueError, match="block scales"):
        moe_fp8_block.fused_moe_fp8_block(x, w13, w2, weights, ids, s13[:, 0, 0], s2[:, 0, 0])
    with pytest.raises(ValueError, match="block scales"):
        reference.fused_moe_fp8_block(x, w13, w2, weights, ids)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_captures_the_block_kernels() -> None:
    """No host sync: quantization, sort, GEMMs and sum (and the decode GEMVs) captured,
    replayed to the eager results."""
    for num_tokens, fn in (
        (21, moe_fp8_block.fused_moe_fp8_block),
        (3, moe_decode.fused_moe_decode),
    ):
        args = _case(num_tokens, 2, torch.bfloat16)
        eager = fn(*args)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = fn(*args)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(captured, eager, atol=0, rtol=0)
