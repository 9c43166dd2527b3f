"""INT4 weight rounding for `kiln build --quantization int4-gptq | int4-awq`: asymmetric 4-bit
codes with a scale and a zero point per group of 128 inputs, the layout Int4LinearMethod runs
(w = (code - zero) * scale, codes 0..15).

int4-gptq: GPTQ (Frantar et al., 2022) with llm-compressor's default activation ordering
("static": columns by descending diag(H), each group's scale and zero from its weights before
rounding, the groups contiguous in input order), layer after layer through
kiln.builder.calibrate.sequential (Int4Rounder).

int4-awq: AWQ's activation-aware scaling (Lin et al., 2023): per projection, input channel j's
weights are multiplied by s_j = mean|x_j| ^ alpha (and its input divided by s_j, folded into the
op before, kiln.builder.calibrate.smoothing), alpha searched on a grid over [0, 1] for the least
output error; then each (row, group)'s range is clipped by the shrink ratio with the least
output error, and the weights round to nearest. The output error of a weight change D is
tr(D H D^T) with H the inputs' mean x x^T on the calibration text: the linear's own output, not
AutoAWQ's whole-block output, so one pass over the text gives every layer's statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from kiln.builder.calibrate.calibration import WrappingMethod, observe_projections
from kiln.builder.calibrate.gptq import HessianObserver, column_order, damped
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM

GROUP_SIZE = 128  # or the largest of 64, 32 that divides every projection's inputs
MAX_CODE = 15
ALPHA_GRID = 20  # alphas 0, 1/20, ..., 1: AutoAWQ's n_grid
CLIP_RATIOS = tuple(1.0 - i / 20 for i in range(10))  # 1.0 ... 0.55: AutoAWQ's max_shrink 0.5
GPTQ_DAMP = 0.01  # of H's mean diagonal: AutoGPTQ's damp_percent

# (codes [out, in] int32 in 0..15, scales [out, groups] fp32, zeros [out, groups] fp32)
Int4Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def group_range(
    w: torch.Tensor, ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:  # ([..., 1] scale, [..., 1] zero)
    """The asymmetric scale and zero of weight groups w [..., group], their range shrunk by
    `ratio` (AWQ's clipping), as AutoAWQ computes them: scale (max - min) / 15, zero
    round(-min / scale) in 0..15."""
    hi, lo = w.amax(dim=-1, keepdim=True) * ratio, w.amin(dim=-1, keepdim=True) * ratio
    scale = ((hi - lo) / MAX_CODE).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, MAX_CODE)
    return scale, zero


def quantize_groups(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """Codes of w with its (broadcast) scale and zero."""
    return torch.clamp(torch.round(w / scale) + zero, 0, MAX_CODE)


def rtn_int4(w: torch.Tensor, group_size: int = GROUP_SIZE) -> Int4Weights:
    """Round to nearest, each (row, group)'s full range."""
    return clip_int4(w, None, group_size)


def clip_int4(
    w: torch.Tensor,  # [out, in]
    hessian: torch.Tensor | None,  # [in, in]: with it, AWQ's clipping search per (row, group)
    group_size: int = GROUP_SIZE,
) -> Int4Weights:
    """Round to nearest with each (row, group)'s range shrunk by the ratio of CLIP_RATIOS that
    leaves the least error in the output (D_g H_gg D_g^T, the group's own block of H), or the
    full range without `hessian`."""
    out, k = w.shape
    groups = w.float().reshape(out, k // group_size, group_size)
    ratio = torch.ones(out, k // group_size, 1, dtype=groups.dtype, device=w.device)
    if hessian is not None:
        h = hessian.float().to(w.device)
        best = torch.full((out, k // group_size), float("inf"), device=w.device)
        for r in CLIP_RATIOS:
            scale, zero = group_range(groups, r)
            diff = groups - (quantize_groups(groups, scale, zero) - zero) * scale
            errors = torch.stack([
                ((diff[:, g] @ h[g * group_size:(g + 1) * group_size,
                                 g * group_size:(g + 1) * group_size]) * diff[:, g]).sum(-1)
                for g in range(k // group_size)
            ], dim=1)  # fmt: skip
            better = errors < best
            best = torch.where(better, errors, best)
            ratio[better] = r
    scale, zero = group_range(groups, ratio)
    codes = quantize_groups(groups, scale, zero)
    return codes.reshape(out, k).to(torch.int32), scale[..., 0], zero[..., 0]


def dequantize(weights: Int4Weights, group_size: int = GROUP_SIZE) -> torch.Tensor:
    codes, scales, zeros = weights
    s = scales.repeat_interleave(group_size, 1)
    return (codes.float() - zeros.repeat_interleave(group_size, 1)) * s


def gptq_int4(
    weight: torch.Tensor,  # [out, in]
    hessian: torch.Tensor,  # [in, in]
    group_size: int = GROUP_SIZE,
    damp: float = GPTQ_DAMP,
    act_order: bool = True,
) -> Int4Weights:
    """GPTQ's rounding to asymmetric INT4 groups: each column's rounding error moves the columns
    not yet rounded through the upper Cholesky factor of H^-1. `act_order` (llm-compressor's
    default "static" activation ordering): columns round by descending diag(H), each with its
    input-order group's scale and zero taken from the weights before any rounding (so the
    groups stay contiguous: no g_idx); else in input order, a group's scale and zero from its
    columns as they stand when its first column rounds."""
    out, k = weight.shape
    w = weight.double()
    order = column_order(hessian) if act_order else torch.arange(k, device=weight.device)
    h = damped(hessian.to(weight.device), damp)[order][:, order]
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    scales = torch.empty(out, k // group_size, dtype=torch.float64, device=w.device)
    zeros = torch.empty_like(scales)
    if act_order:  # static groups: from the weights as they are
        scale, zero = group_range(w.reshape(out, k // group_size, group_size))
        scales, zeros = scale[..., 0], zero[..., 0]
    group_of = order // group_size  # the group of each column in rounding order
    w = w[:, order].clone()
    codes = torch.empty(out, k, dtype=torch.int32, device=w.device)
    for start in range(0, k, group_size):
        end = start + group_size
        block = w[:, start:end].clone()
        if not act_order:
            scale, zero = group_range(block)
            scales[:, start // group_size], zeros[:, start // group_size] = scale[:, 0], zero[:, 0]
        errors = torch.empty_like(block)
        hb = hinv[start:end, start:end]
        for i in range(group_size):
            column = block[:, i : i + 1]
            g = int(group_of[start + i])
            scale, zero = scales[:, g : g + 1], zeros[:, g : g + 1]
            code = quantize_groups(column, scale, zero)
            codes[:, start + i] = code[:, 0].to(torch.int32)
            err = (column - (code - zero) * scale) / hb[i, i]
            block[:, i:] -= err @ hb[i : i + 1, i:]
            errors[:, i : i + 1] = err
        w[:, end:] -= errors @ hinv[start:end, end:]
    codes = codes[:, torch.argsort(order)]
    return codes, scales.float(), zeros.float()


def pack(weights: Int4Weights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weight [out, in / 8] int32, weight_scales, weight_zeros): Int4LinearMethod's tensors."""
    from kiln.kernels.reference import pack_int4

    codes, scales, zeros = weights
    return pack_int4(codes), scales.contiguous(), zeros.contiguous()


class Int4Rounder(WrappingMethod):
    """Layer-sequential GPTQ's rounder for INT4 (kiln.builder.calibrate.sequential): on its one
    call, rounds the layer's weight by GPTQ from the inputs it is given (H = x x^T / rows), then
    answers as the INT4 engine would (ops.int4_linear with those codes)."""

    def __init__(
        self, inner: LinearMethod, group_size: int = GROUP_SIZE, damp: float = GPTQ_DAMP
    ) -> None:
        self.inner, self.group_size, self.damp = inner, group_size, damp
        self.result: Int4Weights | None = None

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if self.result is not None:
            raise RuntimeError("layer-sequential rounding runs each layer once")
        rows = x.reshape(-1, x.shape[-1]).float()
        hessian = rows.T @ rows / rows.shape[0]
        weight = layer.weight.detach().float()
        self.result = gptq_int4(weight, hessian, self.group_size, self.damp)
        qweight, scales, zeros = pack(self.result)
        return ops.int4_linear(x, qweight, scales, zeros, layer.bias)


class ActivationObserver(HessianObserver):
    """HessianObserver that also sums |x| per input channel (AWQ's activation statistic)."""

    def __init__(self, inner: LinearMethod) -> None:
        super().__init__(inner)
        self.abs_sum: torch.Tensor | None = None

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0]:
            sums = rows.abs().sum(0)
            self.abs_sum = sums if self.abs_sum is None else self.abs_sum + sums
        return super().apply(layer, ops, x)


def calibrate_activations(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer name -> (H = mean x x^T [in, in], mean |x| [in]), on the CPU, for every decoder
    projection; `run` as calibrate_input_scales takes it."""
    observers = observe_projections(model, ActivationObserver, token_batches, run)
    found = {}
    for name, o in observers.items():
        if o.hessian is None or o.abs_sum is None:
            raise ValueError(f"calibration saw no input to {name!r}")
        found[name] = ((o.hessian / o.rows).cpu(), (o.abs_sum / o.rows).cpu())
    return found


def output_error(diff: torch.Tensor, hessian: torch.Tensor) -> float:
    """tr(D H D^T): the summed squared output change of weight change D over inputs with mean
    x x^T = H (per row of inputs)."""
    return float(((diff @ hessian) * diff).sum())


def awq_scale(
    weight: torch.Tensor,  # [out, in]
    hessian: torch.Tensor,  # [in, in]
    act_mean: torch.Tensor,  # [in] mean |x|, equal where the factors must be (GQA's o_proj)
    group_size: int = GROUP_SIZE,
) -> tuple[torch.Tensor, float]:
    """(the factors s [in] of the alpha with the least output error, that alpha): s = act_mean ^
    alpha normalized by sqrt(max * min), the weight's columns times s rounded to nearest, the
    error measured on the unscaled inputs (x / s times the rounded weight)."""
    w, h = weight.float(), hessian.float().to(weight.device)
    mean = act_mean.float().to(weight.device).clamp(min=1e-6)
    best = (torch.ones_like(mean), float("inf"), 0.0)
    for i in range(ALPHA_GRID + 1):
        alpha = i / ALPHA_GRID
        s = mean.pow(alpha)
        s = s / (s.max() * s.min()).sqrt()
        rounded = dequantize(rtn_int4(w * s, group_size), group_size) / s
        error = output_error(rounded - w, h)
        if error < best[1]:
            best = (s, error, alpha)
    return best[0], best[2]
