"""The INT4 builds' rounding (kiln.builder.calibrate.int4): GPTQ and AWQ lower the output error
of round to nearest on inputs with correlated and outlier channels, and their codes are the
Int4LinearMethod layout's."""

from __future__ import annotations

import pytest
import torch

from kiln.builder.calibrate import int4
from kiln.kernels.reference import dequantize_int4


def _inputs(rows: int = 512, k: int = 256, seed: int = 0) -> torch.Tensor:
    """Activations with correlated channels and a few loud ones, as an LLM's are."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) @ (torch.eye(k) + 0.3 * torch.randn(k, k, generator=g))
    x[:, :4] *= 20.0
    return x


def _weight(out: int = 64, k: int = 256, seed: int = 1) -> torch.Tensor:
    return torch.randn(out, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def _error(weight: torch.Tensor, rounded: torch.Tensor, x: torch.Tensor) -> float:
    return float((x @ (rounded - weight).T).square().sum())


def test_codes_are_the_int4_layout_and_dequantize_as_the_kernels_read_them() -> None:
    w = _weight()
    codes, scales, zeros = weights = int4.rtn_int4(w)
    assert codes.dtype == torch.int32 and int(codes.min()) >= 0 and int(codes.max()) <= 15
    assert scales.shape == zeros.shape == (64, 2)
    packed, s, z = int4.pack(weights)
    assert torch.equal(dequantize_int4(packed, s, z), int4.dequantize(weights))
    # Round to nearest: within half a step of every weight.
    step = scales.repeat_interleave(int4.GROUP_SIZE, 1)
    assert ((int4.dequantize(weights) - w).abs() <= step / 2 + 1e-7).all()


@pytest.mark.parametrize("act_order", [True, False])
def test_gptq_lowers_the_output_error_of_round_to_nearest(act_order) -> None:
    x, w = _inputs(), _weight()
    hessian = x.T @ x / x.shape[0]
    nearest = _error(w, int4.dequantize(int4.rtn_int4(w)), x)
    weights = int4.gptq_int4(w, hessian, act_order=act_order)
    assert _error(w, int4.dequantize(weights), x) < 0.8 * nearest
    if act_order:  # static groups: the scales and zeros of round to nearest, codes moved
        _, scales, zeros = int4.rtn_int4(w)
        torch.testing.assert_close(weights[1], scales)
        torch.testing.assert_close(weights[2], zeros)


def test_gptq_with_64_input_groups() -> None:
    x, w = _inputs(k=192), _weight(k=192)
    _, scales, _ = weights = int4.gptq_int4(w, x.T @ x / x.shape[0], group_size=64)
    assert scales.shape == (64, 3)
    assert _error(w, int4.dequantize(weights, 64), x) < _error(
        w, int4.dequantize(int4.rtn_int4(w, 64), 64), x
    )


def test_awq_scales_and_clipping_lower_the_output_error() -> None:
    x, w = _inputs(), _weight()
    hessian, mean = x.T @ x / x.shape[0], x.abs().mean(0)
    nearest = _error(w, int4.dequantize(int4.rtn_int4(w)), x)
    s, alpha = int4.awq_scale(w, hessian, mean)
    assert 0.0 < alpha <= 1.0  # the loud channels' weights are worth protecting
    scaled = _error(w, int4.dequantize(int4.rtn_int4(w * s)) / s, x)
    assert scaled < nearest, (scaled, nearest)
    # The clipping search, on the scaled weights' inputs x / s.
    clipped = int4.clip_int4(w * s, hessian / (s[:, None] * s[None, :]))
    assert _error(w, int4.dequantize(clipped) / s, x) <= scaled
