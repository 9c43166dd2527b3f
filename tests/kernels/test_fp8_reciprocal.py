"""FP8 activation quantization rounds the IEEE quotient x / scale, not x * (1 / scale): the
reference (reference.quantize_fp8) divides, and every Triton kernel that quantizes activations
(quantize_fp8, add+RMSNorm+quantize, SiLU-mul+quantize, the one-row float8 small-batch linears)
gets the same quotient from the scale's reciprocal and two FMAs (fp8_gemm.scaled_to_e4m3); a bare
product would break exact ties away from zero. The forms differ only at values within an fp32 ulp
of an e4m3 rounding boundary, so random inputs almost never tell them apart: these tests search
for values where they round to different codes and check each kernel at them (on the GPU; the
interpreter divides), and check the FMA formula itself against the division at every bf16
activation over every bf16 absmax significand, in exact float64 emulation."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

from kiln.kernels import reference
from kiln.kernels.triton import fp8_gemm, silu_mul, small_batch_linear
from kiln.kernels.triton.rms_norm import add_rms_norm_quant_fp8

FP8 = torch.float8_e4m3fn
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# A scale whose reciprocal is inexact in fp32 (a power of two's would make both forms agree).
STATIC_SCALE = torch.tensor(0.0123, dtype=torch.float32)


def _codes(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(FP8).view(torch.uint8)


def _boundary_values(scale: torch.Tensor) -> torch.Tensor:
    """fp32 values x (both signs) where x / scale and x * (1 / scale) give different e4m3 codes:
    the fp32 neighbours (within 4 ulps) of each midpoint between adjacent e4m3 values times
    scale, kept where the two roundings part."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(FP8).float()  # 0 .. 448, NaN left out
    x = ((grid[1:] + grid[:-1]) / 2) * scale
    candidates = [x]
    up, down = x, x
    for _ in range(4):
        up = torch.nextafter(up, torch.tensor(float("inf")))
        down = torch.nextafter(down, torch.tensor(0.0))
        candidates += [up, down]
    x = torch.cat(candidates)
    x = torch.cat([x, -x])
    parted = _codes(x / scale) != _codes(x * (1.0 / scale))
    found = x[parted]
    # The premise of every test here: such values exist (about one candidate in ten).
    assert found.numel() >= 16, found.numel()
    return found


def _dynamic_row(num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A row [absmax, boundary values at the row's own dynamic scale ...] of num values, and
    that scale (absmax / 448, as reference.quantize_fp8 computes it)."""
    absmax = torch.tensor(448 * 0.0123, dtype=torch.float32)
    scale = (absmax / reference.FP8_E4M3_MAX).clamp(min=reference.FP8_MIN_SCALE)
    values = _boundary_values(scale)
    return torch.cat([absmax.view(1), values[: num - 1]]), scale


def _row(dynamic: bool, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    if dynamic:
        return _dynamic_row(num)
    return _boundary_values(STATIC_SCALE)[:num], STATIC_SCALE


def _expected(row: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the codes by the reciprocal, the codes by division) of row at scale."""
    return _codes(row * (1.0 / scale)), _codes(row / scale)


def _input_scale(dynamic: bool) -> torch.Tensor | None:
    return None if dynamic else STATIC_SCALE.to(DEVICE)


def _check(codes: torch.Tensor, row: torch.Tensor, scale: torch.Tensor) -> None:
    by_reciprocal, by_division = _expected(row, scale)
    codes = codes.reshape(-1).cpu()
    assert torch.equal(codes, by_division)
    differs = codes != by_reciprocal
    if row.numel() > 1 and abs(row[0]) == row.abs().max():  # dynamic: the absmax agrees
        differs = differs[1:]
    assert bool(differs.all())


@pytest.mark.parametrize("dynamic", [False, True])
def test_reference_rounds_the_quotient(dynamic: bool) -> None:
    row, scale = _row(dynamic, 40)
    x_fp8, x_scale = reference.quantize_fp8(row.view(1, -1), None if dynamic else scale)
    assert torch.equal(x_scale.reshape(()), scale)  # the scale returned is still the scale
    _check(x_fp8.view(torch.uint8), row, scale)


@pytest.mark.parametrize("dynamic", [False, True])
def test_quantize_kernel_matches_the_reference(dynamic: bool) -> None:
    row, scale = _row(dynamic, 40)
    x = row.view(1, -1).repeat(3, 1).to(DEVICE)
    x_fp8, x_scale = fp8_gemm.quantize_fp8(x, _input_scale(dynamic))
    ref_fp8, _ = reference.quantize_fp8(x.cpu(), None if dynamic else scale)
    assert torch.equal(x_fp8.view(torch.uint8).cpu(), ref_fp8.view(torch.uint8))
    assert torch.equal(x_scale.reshape(-1)[0].cpu(), scale)
    _check(x_fp8[1].view(torch.uint8), row, scale)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_rms_norm_quant_kernel_matches_the_reference(dynamic: bool, residual: bool) -> None:
    # x of ones with eps 0 normalises to exactly 1, so the normed row is the norm weight: the
    # boundary values go in as the weight.
    row, scale = _row(dynamic, 40)
    x = torch.ones(2, row.numel(), device=DEVICE)
    res = torch.zeros_like(x) if residual else None
    weight = row.to(DEVICE)
    x_fp8, _, _ = add_rms_norm_quant_fp8(x, res, weight, 0.0, _input_scale(dynamic))
    ref_fp8, _, _ = reference.add_rms_norm_quant_fp8(
        x.cpu(), None if res is None else res.cpu(), weight.cpu(), 0.0, None if dynamic else scale
    )
    assert torch.equal(x_fp8.view(torch.uint8).cpu(), ref_fp8.view(torch.uint8))
    _check(x_fp8[0].view(torch.uint8), row, scale)


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_silu_mul_quant_kernel_matches_the_reference(
    dynamic: bool, two_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # silu(32) is 32 exactly in fp32 (1 + exp(-32) rounds to 1), and 32 * (v / 32) is v: the
    # product entering the quantization is the boundary value itself.
    if two_pass:  # rows wider than the one-pass limit loop over blocks
        monkeypatch.setattr(silu_mul, "_QUANT_ONE_PASS_MAX", 16)
        monkeypatch.setattr(silu_mul, "_QUANT_LOOP_BLOCK", 16)
        monkeypatch.setattr(silu_mul, "_static_quant_tiles", lambda d, rows: (16, 1))
    row, scale = _row(dynamic, 40)
    gate = torch.full_like(row, 32.0)
    x = torch.cat([gate, row / 32]).view(1, -1).repeat(2, 1).to(DEVICE)
    x_fp8, _ = silu_mul.silu_and_mul_quant_fp8(x, _input_scale(dynamic))
    ref_fp8, _ = reference.silu_and_mul_quant_fp8(x.cpu(), None if dynamic else scale)
    assert torch.equal(x_fp8.view(torch.uint8).cpu(), ref_fp8.view(torch.uint8))
    _check(x_fp8[0].view(torch.uint8), row, scale)


@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("dynamic", [False, True])
def test_one_row_fp8_linear_quantizes_like_the_reference(dynamic: bool, norm: bool) -> None:
    # One row is quantized inside the small-batch kernel; an identity float8 weight (unit
    # scales) puts each activation's code times its scale in the output.
    k = 32
    row, scale = _row(dynamic, k)
    eye = torch.eye(k).to(FP8).to(DEVICE)
    ones = torch.ones(k, device=DEVICE)
    if norm:  # x of ones normalises to 1 (eps 0): the normed row is the norm weight
        x = torch.ones(1, k, device=DEVICE)
        out, _ = small_batch_linear.add_rms_norm_linear(
            x, None, row.to(DEVICE), 0.0, eye, None, ones, _input_scale(dynamic)
        )
    else:
        out = small_batch_linear.fp8_linear(
            row.view(1, k).to(DEVICE), eye, ones, _input_scale(dynamic)
        )
    by_reciprocal, by_division = _expected(row, scale)
    want = by_division.view(FP8).float() * scale
    torch.testing.assert_close(out.view(-1).cpu(), want, rtol=0, atol=0)
    parted = by_reciprocal != by_division
    wrong = by_reciprocal.view(FP8).float()[parted] * scale
    assert bool((out.view(-1).cpu()[parted] != wrong).all())


@pytest.mark.parametrize("static", [False, True])
def test_fused_silu_mul_quant_equals_the_unfused_kernels_at_every_bf16_gate(static: bool) -> None:
    # On the GPU the fused kernel's SiLU is ex2 and rcp without div.full's rescaling
    # (silu_mul._silu_f32); the unfused SiLU-mul kernel keeps Triton's `/` and tl.exp. The
    # float8 codes must be the same at every finite bf16 gate (-87.3 and below included, where
    # the fused SiLU is -0 and the unfused one a value under 6e-37 in magnitude).
    gates = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[torch.isfinite(gates)].view(256, 255)
    up = torch.ones_like(gates)
    x = torch.cat([gates, up], dim=1).to(DEVICE)
    scale = torch.tensor(0.01, device=DEVICE) if static else None
    fused, fused_scale = silu_mul.silu_and_mul_quant_fp8(x, scale)
    unfused, unfused_scale = fp8_gemm.quantize_fp8(silu_mul.silu_and_mul(x), scale)
    assert torch.equal(fused_scale, unfused_scale)
    assert torch.equal(fused.view(torch.uint8), unfused.view(torch.uint8))


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 fma(a, b, c), rounded once: a * b is exact in float64, and the float64 sum's own
    rounding is undone where it would make a second one matter (a sum that lands exactly
    between two fp32 values while the exact sum does not)."""
    p = a.double() * b.double()
    s = p + c.double()
    low = s - p  # TwoSum: s + err is exactly p + c
    err = (p - (s - low)) + (c.double() - low)
    s32 = s.float()
    toward = torch.where(s > s32.double(), torch.inf, -torch.inf).float()
    neighbour = torch.nextafter(s32, toward)
    tie = (s != s32.double()) & (s == (s32.double() + neighbour.double()) / 2) & (err != 0)
    nudged = torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).double())
    return torch.where(tie, nudged, s).float()


def _fma_corrected(x: torch.Tensor, scale: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """fp8_gemm.scaled_to_e4m3's GPU arithmetic, step by step in fp32."""
    q = (x * inv).clamp(-2 * 448.0, 2 * 448.0)
    r = _fma(q, scale.expand_as(q), -x)
    return _fma(r, -inv.expand_as(q), q).clamp(-448.0, 448.0)


def _bf16_values(low: float, high: float) -> torch.Tensor:
    """Every bf16 value of magnitude in [low, high], both signs, and both zeros, as fp32."""
    bits = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    bits = bits[(bits >= low) & (bits <= high)]
    return torch.cat([bits, -bits, torch.tensor([0.0, -0.0])])


def test_the_fma_corrected_quotient_is_the_division_at_every_bf16_ratio() -> None:
    # Dynamic scales: every bf16 absmax significand (the ratio x / absmax, not the exponent,
    # decides the rounding), scale = absmax / 448 as the kernels compute it, and every bf16
    # activation from absmax / 2^10 (below it the codes are subnormal) up to absmax.
    absmax = torch.arange(128, dtype=torch.float32) / 128 + 1  # 1, 1 + 2^-7, ... (bf16)
    x = _bf16_values(2.0**-10, 2.0)[None, :]
    scale = (absmax / reference.FP8_E4M3_MAX)[:, None]
    inv = 1.0 / scale
    x = torch.where(x.abs() <= absmax[:, None], x, 0.0)
    by_division = _codes(x / scale)
    assert torch.equal(_codes(_fma_corrected(x, scale, inv)), by_division)
    zeros = torch.tensor([0.0, -0.0])
    assert torch.equal(
        _codes(_fma_corrected(zeros, scale[0], inv[0])), torch.tensor([0, 0x80]).byte()
    )
    ties_moved = int((_codes(x * inv) != by_division).sum())
    assert ties_moved > 100  # the bare product does differ here (the case the formula is for)


def test_the_fma_corrected_quotient_is_the_division_at_static_scales() -> None:
    # Static scales: any fp32 value, and activations on both sides of the saturation (x / scale
    # up to 2^14, where the product would overflow a guard-free correction at huge values).
    gen = torch.Generator().manual_seed(0)
    scale = torch.exp2(torch.empty(64).uniform_(-20, 20, generator=gen))[:, None]
    inv = 1.0 / scale
    ratios = _bf16_values(2.0**-10, 2.0**14)[None, :]
    x = (ratios * scale).bfloat16().float()
    assert torch.equal(_codes(_fma_corrected(x, scale, inv)), _codes(x / scale))
    big = torch.tensor([3e38, -3e38, torch.inf, -torch.inf])
    assert torch.equal(
        _fma_corrected(big, torch.tensor(1e-3), torch.tensor(1e3)),
        torch.tensor([448.0, -448.0, 448.0, -448.0]),
    )
