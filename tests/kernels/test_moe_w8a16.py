"""8-bit weight-only experts (kiln.layers.moe_w8a16: int8 codes, a scale per expert and output
channel) on the float8 per-channel experts' kernels, the codes widened in registers, against
their twins under the interpreter at tiny shapes: the decode GEMVs (moe_decode.fused_moe_decode,
its split down variant and fused_moe_decode_routed) and the weight-only grouped GEMM
(fused_moe.fused_moe with scales), widths not multiples of the tiles; and the twins against the
loop over experts on the weights dequantized here (code * scale in fp32); per channel and with
a scale per row and 128 inputs (W8A16 in groups of 128: the decode GEMVs' block-scaled variant,
the grouped GEMM's ROW_BLOCKS)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.layers.moe_w8a16 import quantize_experts_w8
from tests.kernels.moe_checks import close_to_peak as _close

moe_decode = importlib.import_module("kiln.kernels.triton.moe_decode")
fused_moe = importlib.import_module("kiln.kernels.triton.fused_moe")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
HIDDEN, INTER, EXPERTS = 48, 40, 4  # masked column tiles and reductions


# Groups of 128 inputs (W8A16 g128): 2 groups a row each, the last partial.
G_HIDDEN, G_INTER = 160, 136


def _case(num_tokens: int, top_k: int, dtype: torch.dtype, remote: bool = False,
          grouped: bool = False):  # fmt: skip
    """fused_moe's arguments on int8 experts; `remote`: some ids -1 (another rank's);
    `grouped`: a scale per row and 128 inputs ([E, rows, ceil(K / 128)])."""
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    hidden, inter = (G_HIDDEN, G_INTER) if grouped else (HIDDEN, INTER)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = torch.randint(-127, 128, (EXPERTS, 2 * inter, hidden), generator=gen).to(torch.int8)
    w2 = torch.randint(-127, 128, (EXPERTS, hidden, inter), generator=gen).to(torch.int8)
    blocks13 = (-(-hidden // 128),) if grouped else ()
    blocks2 = (-(-inter // 128),) if grouped else ()
    s13 = torch.rand(EXPERTS, 2 * inter, *blocks13, generator=gen) * 2e-3 + 1e-3
    s2 = torch.rand(EXPERTS, hidden, *blocks2, generator=gen) * 2e-3 + 1e-3
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    if remote:
        ids[::3, 0] = -1
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids, s13, s2)]


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 2), (3, 2), (16, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_decode_kernels_equal_their_twin(num_tokens, top_k, dtype) -> None:
    args = _case(num_tokens, top_k, dtype)
    got = moe_decode.fused_moe_decode(*args)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    _close(got, reference.fused_moe_decode(*args), dtype)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (3, 2)])  # the interpreter's cost: few
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_int8_decode_kernels_equal_their_twin(num_tokens, top_k, dtype) -> None:
    """Groups of 128 inputs: the block-scaled GEMVs' variant on int8 codes."""
    args = _case(num_tokens, top_k, dtype, grouped=True)
    got = moe_decode.fused_moe_decode(*args)
    assert got.dtype == dtype and got.shape == (num_tokens, G_HIDDEN)
    _close(got, reference.fused_moe_decode(*args), dtype)


def test_int8_decode_split_down_variant_equals_the_twin() -> None:
    args = _case(3, 2, torch.float32)
    x, w13, w2, weights, ids, s13, s2 = args
    tiles = (8, 16, 4, 8, 16, 4, 1, 0)
    got = moe_decode.fused_moe_decode_tiled(x, w13, w2, weights, ids, s13, s2, tiles)
    _close(got, reference.fused_moe_decode(*args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("remote", [False, True])
@pytest.mark.parametrize("grouped", [False, True])
def test_int8_weight_only_grouped_gemm_equals_its_twin(dtype, remote, grouped) -> None:
    args = _case(21, 2, dtype, remote, grouped)
    got = fused_moe.fused_moe(*args)
    assert got.dtype == dtype and got.shape == (21, args[0].shape[1])
    _close(got, reference.fused_moe(*args), dtype)


def test_int8_routed_decode_equals_its_twin() -> None:
    """The block's norm and routing inside the gate_up launch, on int8 codes."""
    x, w13, w2, _, _, s13, s2 = _case(5, 2, torch.float32)
    gen = torch.Generator().manual_seed(7)
    norm = (torch.rand(HIDDEN, generator=gen) + 0.5).to(DEVICE)
    logits = torch.randn(5, EXPERTS, generator=gen).to(DEVICE)
    args = (x, norm, 1e-6, logits, 2, True, w13, w2, s13, s2)
    want = reference.fused_moe_decode_routed(*args)
    _close(moe_decode.fused_moe_decode_routed(*args), want, torch.float32)
    weights, ids = reference.moe_route(logits, 2, True, x.dtype)
    normed = reference.rms_norm(x, norm, 1e-6)
    _close(want, reference.fused_moe_decode(normed, w13, w2, weights, ids, s13, s2), torch.float32)


@pytest.mark.parametrize("grouped", [False, True])
def test_the_twins_are_the_loop_over_the_dequantized_experts(grouped) -> None:
    x, w13, w2, weights, ids, s13, s2 = _case(5, 2, torch.float32, grouped=grouped)
    if grouped:  # input k of a row scaled by its column k // 128
        dense13 = w13.float() * s13.repeat_interleave(128, dim=2)[:, :, : w13.shape[2]]
        dense2 = w2.float() * s2.repeat_interleave(128, dim=2)[:, :, : w2.shape[2]]
    else:
        dense13 = w13.float() * s13[:, :, None]
        dense2 = w2.float() * s2[:, :, None]
    want = reference.fused_moe(x, dense13, dense2, weights, ids)
    args = (x, w13, w2, weights, ids, s13, s2)
    _close(reference.fused_moe(*args), want, torch.float32)
    _close(reference.fused_moe_decode(*args), want, torch.float32)


def test_quantize_experts_w8_rounds_each_row_by_its_absmax() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(EXPERTS, 6, 32, generator=gen)
    codes, scales = quantize_experts_w8(w, torch.int8)
    assert codes.dtype == torch.int8 and scales.shape == (EXPERTS, 6)
    torch.testing.assert_close(scales, w.abs().amax(dim=2) / 127)
    assert torch.equal(codes.abs().amax(dim=2), torch.full((EXPERTS, 6), 127, dtype=torch.int8))
    err = (codes.float() * scales[:, :, None] - w).abs()
    assert bool((err <= scales[:, :, None] / 2 + 1e-7).all())
