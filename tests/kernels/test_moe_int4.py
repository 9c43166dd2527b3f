"""The INT4 (W4A16) experts' kernels against their twins under the interpreter at tiny shapes:
the decode GEMVs' INT4 variants (moe_decode.fused_moe_int4_decode vs
reference.fused_moe_int4_decode) and the grouped GEMM's (fused_moe.fused_moe_int4 vs
reference.fused_moe_int4), widths not multiples of the tiles and two group sizes; and the twins
against the loop over experts on the dequantized weights (reference.fused_moe)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from tests.kernels.moe_checks import close_to_peak as _close

moe_decode = importlib.import_module("kiln.kernels.triton.moe_decode")
fused_moe = importlib.import_module("kiln.kernels.triton.fused_moe")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# gate_up: 48 inputs in groups of 16; down: 40 inputs in groups of 8 (masked column tiles).
HIDDEN, INTER, EXPERTS = 48, 40, 4


def _experts(rows: int, cols: int, group: int, gen: torch.Generator):
    words = torch.randint(-(2**31), 2**31 - 1, (EXPERTS, rows, cols // 8), generator=gen)
    scales = torch.rand(EXPERTS, rows, cols // group, generator=gen) * 0.05 + 0.01
    zeros = torch.randint(0, 16, (EXPERTS, rows, cols // group), generator=gen).float()
    return words.to(torch.int32), scales, zeros


def _case(
    num_tokens: int,
    top_k: int,
    dtype: torch.dtype,
    remote: bool = False,
    shape: tuple[int, int, int, int] = (HIDDEN, INTER, 16, 8),  # hidden, inter, their groups
):
    """fused_moe_int4's arguments; `remote`: some ids -1 (another rank's experts)."""
    hidden, inter, group13, group2 = shape
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13, s13, z13 = _experts(2 * inter, hidden, group13, gen)
    w2, s2, z2 = _experts(hidden, inter, group2, gen)
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    if remote:
        ids[::3, 0] = -1
    weights = torch.rand(num_tokens, top_k, generator=gen)
    args = (x, w13, w2, weights, ids, s13, s2, z13, z2)
    return [t.to(DEVICE) for t in args]


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 2), (3, 2), (16, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int4_decode_kernels_equal_their_twin(num_tokens, top_k, dtype) -> None:
    args = _case(num_tokens, top_k, dtype)
    got = moe_decode.fused_moe_int4_decode(*args)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    _close(got, reference.fused_moe_int4_decode(*args), dtype)


def test_int4_decode_split_down_variant_equals_the_twin() -> None:
    """The down GEMV split along its reduction (tiles ending in 0) reads INT4 words too."""
    args = _case(3, 2, torch.float32)
    tiles = (8, 16, 4, 8, 16, 4, 1, 0)
    x, w13, w2, weights, ids, s13, s2, z13, z2 = args
    got = moe_decode.fused_moe_decode_tiled(x, w13, w2, weights, ids, s13, s2, tiles,
                                            int4=(z13, z2))  # fmt: skip
    _close(got, reference.fused_moe_int4_decode(*args), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("remote", [False, True])
# Groups narrower than the interpreter's 32-input tile (a scale per input), and as wide or
# wider (one a column); 72 inputs leave the last tile partial.
@pytest.mark.parametrize("shape", [(HIDDEN, INTER, 16, 8), (96, 72, 32, 8), (64, 64, 64, 32)])
def test_int4_grouped_gemm_equals_its_twin(dtype, remote, shape) -> None:
    args = _case(21, 2, dtype, remote, shape)
    got = fused_moe.fused_moe_int4(*args)
    assert got.dtype == dtype and got.shape == (21, shape[0])
    _close(got, reference.fused_moe_int4(*args), dtype)


def test_the_twins_are_the_loop_over_the_dequantized_experts() -> None:
    x, w13, w2, weights, ids, s13, s2, z13, z2 = _case(5, 2, torch.float32)
    dense13 = reference.dequantize_int4_experts(w13, s13, z13)
    dense2 = reference.dequantize_int4_experts(w2, s2, z2)
    # Input k of an expert's row r: bits 4 (k % 8) of word k // 8, its group's scale and zero.
    r, k = 3, 37
    code = (int(w13[1, r, k // 8]) >> (4 * (k % 8))) & 0xF
    assert dense13[1, r, k] == (code - z13[1, r, k // 16]) * s13[1, r, k // 16]
    want = reference.fused_moe(x, dense13, dense2, weights, ids)
    args = (x, w13, w2, weights, ids, s13, s2, z13, z2)
    _close(reference.fused_moe_int4(*args), want, torch.float32)
    _close(reference.fused_moe_int4_decode(*args), want, torch.float32)


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_int4_routed_decode_equals_its_twin(num_tokens) -> None:
    """The block's norm and routing inside the INT4 gate_up launch (fused_moe_decode_routed)."""
    x, w13, w2, _, _, s13, s2, z13, z2 = _case(num_tokens, 2, torch.float32)
    gen = torch.Generator().manual_seed(7)
    norm = (torch.rand(HIDDEN, generator=gen) + 0.5).to(DEVICE)
    logits = torch.randn(num_tokens, EXPERTS, generator=gen).to(DEVICE)
    args = (x, norm, 1e-6, logits, 2, True, w13, w2, s13, s2, None, None, None, None, (z13, z2))
    want = reference.fused_moe_decode_routed(*args)
    _close(moe_decode.fused_moe_decode_routed(*args), want, torch.float32)
    # The twin is rms_norm, moe_route and the INT4 decode in turn.
    weights, ids = reference.moe_route(logits, 2, True, x.dtype)
    normed = reference.rms_norm(x, norm, 1e-6)
    plain = reference.fused_moe_int4_decode(normed, w13, w2, weights, ids, s13, s2, z13, z2)
    _close(want, plain, torch.float32)
