"""GPTQ rounding for float8 weights: each weight column is rounded to e4m3 in turn and the error
it leaves is spread over the columns not yet rounded, weighted by the layer's input statistics
(H = sum of x x^T over calibration tokens), so the layer's output on inputs like those moves
less than with independent round-to-nearest (Frantar et al., 2022, "GPTQ"; here with e4m3's grid
and the same per-output-channel scales as round-to-nearest, so the engine format and kernels do
not change).

`kiln build --weight-rounding gptq` collects H per projection while the source runs over the
calibration text (HessianObserver), then quantizes each weight as it loads with gptq_fp8 instead
of quantize_fp8.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE, quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM
from kiln.quantization.calibration import observe_projections

_BLOCK = 128  # columns rounded together before their error reaches the rest (speed only)
_DAMP = 0.01  # of H's mean diagonal, added to it: keeps H invertible with few tokens


def gptq_fp8(
    weight: torch.Tensor,  # [out, in]
    hessian: torch.Tensor,  # [in, in] fp32: sum of x x^T (any positive multiple)
    damp: float = _DAMP,
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
    hessian: torch.Tensor, damp: float = _DAMP, order: torch.Tensor | None = None
) -> torch.Tensor:  # [in, in] float64
    """The upper Cholesky factor of (damped) H^-1: row i holds how column i's rounding error
    moves the columns after it. One per layer input: a fused projection's shards (q, k, v;
    gate, up) share it. With `order`, of H's rows and columns in that order."""
    h = damped(hessian, damp)
    if order is not None:
        h = h[order][:, order]
    return torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)


def activation_aware_weight(
    weight: torch.Tensor,  # [out, in]
    cross: torch.Tensor,  # [in, in]: sum of x xq^T (x the source's input, xq the engine's)
    hessian_q: torch.Tensor,  # [in, in]: sum of xq xq^T, the same multiple as `cross`
    damp: float = _DAMP,
) -> torch.Tensor:  # [out, in] float64
    """The W' minimising ||W X - W' Xq||^2 + lam ||W' - W||^2: W (C + lam I)(B + lam I)^-1,
    with C = X Xq^T, B = Xq Xq^T and lam = damp * mean(diag B). The engine multiplies its
    quantized input Xq where the source multiplied X; W' absorbs the part of that difference
    that is linear in Xq (a systematic rounding or an upstream layer's error); the ridge term,
    the same damping GPTQ takes, pulls W' to W where the calibration text says little."""
    b = damped(hessian_q, damp)
    lam = b.diagonal() - hessian_q.double().diagonal()  # the damping on each diagonal entry
    c = cross.double() + torch.diag(lam)
    chol = torch.linalg.cholesky(b)
    return torch.cholesky_solve(c.T @ weight.double().T, chol).T


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


class HessianObserver(LinearMethod):
    """Wraps a layer's method: adds x x^T of every input row of apply to `hessian` (fp32, on the
    input's device), otherwise the wrapped method's arithmetic. The fused entry points are the
    base class's, which call this apply on the normed input: the tensor the projection sees."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.hessian: torch.Tensor | None = None
        self.rows = 0

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0]:
            if self.hessian is None:
                self.hessian = torch.zeros(rows.shape[1], rows.shape[1], device=rows.device)
            self.hessian.addmm_(rows.T, rows)
            self.rows += rows.shape[0]
        return self.inner.apply(layer, ops, x)


class ActivationAwareObserver(HessianObserver):
    """HessianObserver for the activation-aware target: of every input row x and xq, the row
    as the engine quantizes it (the quantize_fp8 twin: per token, or with the layer's static
    scale), adds x xq^T to `cross` and xq xq^T to `hessian`."""

    def __init__(self, inner: LinearMethod, input_scale: float | None) -> None:
        super().__init__(inner)
        self.input_scale = input_scale
        self.cross: torch.Tensor | None = None

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        if rows.shape[0]:
            scale = None
            if self.input_scale is not None:
                scale = torch.tensor(self.input_scale, dtype=torch.float32, device=rows.device)
            codes, s = quantize_fp8(rows, scale)
            xq = codes.float() * s
            if self.hessian is None:
                n = rows.shape[1]
                self.cross = torch.zeros(n, n, device=rows.device)
                self.hessian = torch.zeros(n, n, device=rows.device)
            self.cross.addmm_(rows.T, xq)
            self.hessian.addmm_(xq.T, xq)
            self.rows += rows.shape[0]
        return self.inner.apply(layer, ops, x)


def calibrate_activation_aware(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
    input_scales: dict[str, float] | None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(layer name -> Xq Xq^T / rows, layer name -> X Xq^T / rows), on the CPU, for every
    decoder projection, as calibrate_hessians; `input_scales` (static "fp8") quantize the
    inputs as the engine will, None per token."""

    def observer(inner: LinearMethod, name: str) -> ActivationAwareObserver:
        return ActivationAwareObserver(inner, None if input_scales is None else input_scales[name])

    observers = observe_projections(model, None, token_batches, run, named=observer)
    unseen = [name for name, observer in observers.items() if observer.hessian is None]
    if unseen:
        raise ValueError(f"calibration saw no input to {len(unseen)} layers, e.g. {unseen[:3]}")
    return (
        {name: (o.hessian / o.rows).cpu() for name, o in observers.items()},
        {name: (o.cross / o.rows).cpu() for name, o in observers.items()},
    )


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
    return {name: (observer.hessian / observer.rows).cpu() for name, observer in observers.items()}
