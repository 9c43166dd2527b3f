"""The LayerNorm flavour of the norm kernels (kiln/kernels/triton/rms_norm.py: `layer_norm`, an
optional `bias`) against their twins: the plain norm, the fused residual add + norm, and the
float8 / int8 quantizing norms the FP8 / W8A8 projections read. On the CPU under the Triton
interpreter at tiny shapes (fp32, fp16; bf16 too on a GPU), on a GPU at
StableLM-2-1.6B's and Command-R's hidden sizes (bf16)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
on_gpu = pytest.mark.skipif(DEVICE != "cuda", reason="needs a GPU")
# The interpreter rounds bf16 by truncation (the existing norm tests leave it to the GPU too).
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# One rounding of the output dtype (fp32: the sum order of mean and variance).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
EPS = 1e-5


def _inputs(rows: int, hidden: int, dtype: torch.dtype, bias: bool, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    # An offset the mean must take out (a plain RMSNorm of these rows is far from LayerNorm's).
    x = (3 * torch.randn(rows, hidden, generator=gen) + 2.0).to(DEVICE, dtype)
    residual = torch.randn(rows, hidden, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    b = (0.5 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype) if bias else None
    return x, residual, weight, b


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("hidden", [48, 64])  # 48: a row narrower than its lanes
def test_layer_norm_and_its_fused_add_are_their_twins(dtype, bias, hidden) -> None:
    x, residual, weight, b = _inputs(5, hidden, dtype, bias, seed=hidden + bias)
    want = reference.layer_norm(x, weight, b, EPS)
    _close(triton_ops.layer_norm(x, weight, b, EPS), want, dtype)
    _close(triton_ops.rms_norm(x, weight, EPS, b, layer_norm=True), want, dtype)
    assert torch.equal(reference.rms_norm(x, weight, EPS, b, layer_norm=True), want)
    # Far from the RMSNorm of the same rows: the flavour is taken, not ignored.
    assert (want.float() - reference.rms_norm(x, weight, EPS).float()).abs().max() > 0.1

    got, got_sum = triton_ops.fused_add_rms_norm(x, residual, weight, EPS, None, b, True)
    want, want_sum = reference.fused_add_rms_norm(x, residual, weight, EPS, None, b, True)
    assert torch.equal(got_sum, want_sum)
    assert torch.equal(want, reference.layer_norm(x + residual, weight, b, EPS))
    _close(got, want, dtype)


def test_fp32_layer_norm_matches_torch_to_its_last_bits() -> None:
    x, _, weight, b = _inputs(7, 96, torch.float32, True, seed=4)
    got = triton_ops.layer_norm(x, weight, b, EPS)
    want = torch.nn.functional.layer_norm(x, (96,), weight, b, EPS)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-6)


def test_a_bias_without_the_flavour_is_refused() -> None:
    x, _, weight, b = _inputs(2, 16, torch.float32, True, seed=5)
    with pytest.raises(AssertionError, match="LayerNorm"):
        triton_ops.rms_norm(x, weight, EPS, b)
    with pytest.raises(AssertionError, match="LayerNorm"):
        reference.rms_norm(x, weight, EPS, b)


def _fp8_within_a_step(got: torch.Tensor, want: torch.Tensor) -> None:
    """Float8 codes within one e4m3 step of the twin's (a norm's last fp32 bit may move a value
    across a rounding edge), almost all equal."""
    g, w = got.float(), want.float()
    assert ((g - w).abs() <= 2**-3 * w.abs() + 1e-6).all()
    assert (g == w).float().mean() > 0.95


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("static", [False, True])
def test_fp8_quantizing_layer_norm_is_its_twin(dtype, bias, residual, static) -> None:
    x, r, weight, b = _inputs(4, 80, dtype, bias, seed=10 + 2 * bias + residual)
    r = r if residual else None
    scale = torch.tensor(0.02, device=DEVICE) if static else None
    channels = torch.tensor([3, 70], device=DEVICE)  # outlier columns: their remainders too
    args = (x, r, weight, EPS, scale, channels, None, b, True)
    got, got_scale, got_sum = triton_ops.add_rms_norm_quant_fp8(*args)
    want, want_scale, want_sum = reference.add_rms_norm_quant_fp8(*args)
    assert torch.equal(got_sum, want_sum)
    assert got.shape == (4, 82)
    torch.testing.assert_close(got_scale, want_scale, rtol=1e-5, atol=0)
    _fp8_within_a_step(got, want)
    # The twin is quantize_fp8 of the LayerNorm (not of an RMSNorm).
    normed = reference.layer_norm(x if r is None else x + r, weight, b, EPS)
    assert torch.equal(want, reference.quantize_fp8(normed, scale, channels)[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("residual", [False, True])
def test_int8_quantizing_layer_norm_is_its_twin(dtype, bias, residual) -> None:
    x, r, weight, b = _inputs(5, 72, dtype, bias, seed=20 + 2 * bias + residual)
    r = r if residual else None
    got, got_scale, got_sum = triton_ops.add_rms_norm_quant_int8(x, r, weight, EPS, b, True)
    want, want_scale, want_sum = reference.add_rms_norm_quant_int8(x, r, weight, EPS, b, True)
    assert torch.equal(got_sum, want_sum)
    torch.testing.assert_close(got_scale, want_scale, rtol=1e-5, atol=0)
    diff = (got.int() - want.int()).abs()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.97
    normed = reference.layer_norm(x if r is None else x + r, weight, b, EPS)
    assert torch.equal(want, reference.quantize_int8(normed)[0])


@on_gpu
@pytest.mark.parametrize(("hidden", "bias"), [(2048, True), (8192, False)])
def test_layer_norm_kernels_at_stablelm_and_command_r_sizes(hidden, bias) -> None:
    """StableLM-2-1.6B (2048, biased) and Command-R (8192, no bias), bf16, 300 rows."""
    x, r, weight, b = _inputs(300, hidden, torch.bfloat16, bias, seed=hidden)
    got, got_sum = triton_ops.fused_add_rms_norm(x, r, weight, EPS, None, b, True)
    want, want_sum = reference.fused_add_rms_norm(x, r, weight, EPS, None, b, True)
    assert torch.equal(got_sum, want_sum)
    _close(got, want, torch.bfloat16)
    got8, got_scale, _ = triton_ops.add_rms_norm_quant_fp8(x, r, weight, EPS, None, None, None,
                                                           b, True)  # fmt: skip
    want8, want_scale, _ = reference.add_rms_norm_quant_fp8(x, r, weight, EPS, None, None, None,
                                                            b, True)  # fmt: skip
    torch.testing.assert_close(got_scale, want_scale, rtol=1.6e-2, atol=0)
    assert ((got8.float() - want8.float()).abs() <= 2**-2 * want8.float().abs() + 1e-3).all()
    got_i8, _, _ = triton_ops.add_rms_norm_quant_int8(x, r, weight, EPS, b, True)
    want_i8, _, _ = reference.add_rms_norm_quant_int8(x, r, weight, EPS, b, True)
    assert (got_i8.int() - want_i8.int()).abs().max() <= 2
