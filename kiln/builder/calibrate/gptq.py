"""GPTQ rounding for float8 weights: each weight column is rounded to e4m3 in turn and the error
it leaves is spread over the columns not yet rounded, weighted by the layer's input statistics
(H = sum of x x^T over calibration tokens), so the layer's output on inputs like those moves
less than with independent round-to-nearest (Frantar et al., 2022, "GPTQ"; here with e4m3's grid
and the same per-output-channel scales as round-to-nearest, so the engine format and kernels do
not change).

`kiln build --weight-rounding gptq` collects H per projection while the source runs over the
calibration text (HessianObserver), then each projection's float8 method rounds its weight rows
as they load with that layer's GPTQRows instead of to nearest.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from kiln.builder.calibrate.calibration import WrappingMethod, observe_projections
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM

_BLOCK = 128  # columns rounded together before their error reaches the rest (speed only)
DAMP = 0.01  # of H's mean diagonal, added to it: keeps H invertible with few tokens


def gptq_fp8(
    weight: torch.Tensor,  # [out, in]
    hessian: torch.Tensor,  # [in, in] fp32: sum of x x^T (any positive multiple)
    damp: float = DAMP,
    act_order: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8 e4m3, [out, 1] fp32 scale)
    """weight ~= w_fp8 * scale with each row's scale its absmax / 448, as quantize_fp8 (the
    error feedback changes values below the absmax, never the scale). Columns whose input was
    always zero are rounded to nearest (they cannot move the output). `act_order`: columns
    round by descending diag(H), the most active inputs first (their error has the most
    columns left to absorb it)."""
    order = column_order(hessian) if act_order else None
    return round_with_factor(weight, inverse_factor(hessian, damp, order), order)


def column_order(hessian: torch.Tensor) -> torch.Tensor:  # [in] int64
    """act-order's permutation: columns by descending diag(H)."""
    return torch.argsort(torch.diag(hessian), descending=True, stable=True)


def damped(hessian: torch.Tensor, damp: float) -> torch.Tensor:  # [in, in] float64
    """H + damp * mean(diag H) * I, with never-seen inputs' diagonal set to 1 first."""
    h = hessian.double().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1.0
    h += damp * torch.diag(h).mean() * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return h


def inverse_factor(
    hessian: torch.Tensor, damp: float = DAMP, order: torch.Tensor | None = None
) -> torch.Tensor:  # [in, in] float64
    """The upper Cholesky factor of (damped) H^-1: row i holds how column i's rounding error
    moves the columns after it. One per layer input: a fused projection's shards (q, k, v;
    gate, up) share it. With `order`, of H's rows and columns in that order."""
    h = damped(hessian, damp)
    if order is not None:
        h = h[order][:, order]
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def round_with_factor(
    weight: torch.Tensor, hinv: torch.Tensor, order: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # as gptq_fp8, from inverse_factor's result
    """With `order` (the one inverse_factor took), columns round in that order."""
    if order is not None:
        codes, scale = round_with_factor(weight[:, order], hinv)
        return codes[:, torch.argsort(order)], scale
    w = weight.double().clone()
    in_features = w.shape[1]
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    for start in range(0, in_features, _BLOCK):
        end = min(start + _BLOCK, in_features)
        block = w[:, start:end].clone()
        errors = torch.empty_like(block)
        hb = hinv[start:end, start:end]
        for i in range(end - start):
            code = (block[:, i : i + 1] / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
            codes[:, start + i : start + i + 1] = code.to(torch.float8_e4m3fn)
            rounded = codes[:, start + i : start + i + 1].double() * scale
            err = (block[:, i : i + 1] - rounded) / hb[i, i]
            block[:, i:] -= err @ hb[i : i + 1, i:]
            errors[:, i : i + 1] = err
        w[:, end:] -= errors @ hinv[start:end, end:]
    return codes, scale.float()


class HessianObserver(WrappingMethod):
    """Wraps a layer's method: adds x x^T of every input row of apply to `hessian` (fp32, on the
    input's device), otherwise the wrapped method's arithmetic. It offers the blocks no fused
    operands, so they run the norm, then this apply: it sees what the projection multiplies."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.hessian: torch.Tensor | None = None
        self.rows = 0

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0]:
            if self.hessian is None:
                self.hessian = torch.zeros(rows.shape[1], rows.shape[1], device=rows.device)
            self.hessian.addmm_(rows.T, rows)
            self.rows += rows.shape[0]
        return self.inner.apply(layer, ops, x)


def calibrate_hessians(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
) -> dict[str, torch.Tensor]:
    """Layer name (as linear_method_factory takes it) -> H / rows, on the CPU, for every decoder
    projection; `run` as calibrate_input_scales takes it (prefills only, prefix caching off)."""
    observers = observe_projections(model, HessianObserver, token_batches, run)
    unseen = [name for name, observer in observers.items() if observer.hessian is None]
    if unseen:
        raise ValueError(f"calibration saw no input to {len(unseen)} layers, e.g. {unseen[:3]}")
    return {
        name: (o.hessian / o.rows).cpu() for name, o in observers.items() if o.hessian is not None
    }


class GPTQRows:
    """A projection's RowRounder (kiln.layers.quantization): its weight rows rounded by GPTQ
    with the layer's input statistics. One per layer: the factor is computed on first use and
    shared by its fused shards (q, k, v; gate, up), which have one input."""

    def __init__(self, hessian: torch.Tensor) -> None:
        self.hessian = hessian
        self._factor: torch.Tensor | None = None

    def __call__(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._factor is None:
            self._factor = inverse_factor(self.hessian.to(weight.device))
        return round_with_factor(weight, self._factor)
