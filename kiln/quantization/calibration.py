"""Static activation scales for "fp8": run the unquantized model over sample tokens and keep
each projection's largest input magnitude; its scale is absmax / 448, so the largest value seen
maps to e4m3's largest (larger ones at run time saturate).

"mse" (`kiln build --activation-scales mse`, after ModelOpt's and llm-compressor's MSE
observers): a second pass tries scales alpha * absmax / 448 for alpha in ACTIVATION_SCALE_GRID and
keeps, per projection, the one whose quantized input moves the layer's output least, each token's
error relative to its own output. The output error of an input error e is e W^T; rounding errors
of different channels are nearly independent, so its expected size is sum_j e_j^2 |W_:,j|^2 (the
input's squared error weighted by each channel's weight-column norm), and the output's own is
about sum_j x_j^2 |W_:,j|^2. Relative per token because e4m3 is a float format: its rounding
error is a fixed fraction of each value down to 2^-6 * scale, so a plain sum of squares is
dominated by the largest tokens and always keeps absmax; what a one-per-tensor scale costs is the
quiet tokens falling below that, and a token's next-token distribution depends on its own
relative error, not on its size."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE, quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM

ObserverT = TypeVar("ObserverT", bound=LinearMethod)

ACTIVATION_SCALES = ("amax", "mse")
# Fractions of absmax / 448 the "mse" search tries: 1 is "amax"; below it the largest inputs
# saturate and the smallest keep more precision (e4m3 is subnormal below 2^-6 * scale, coarser
# as it falls): worth it where one outlier sets absmax for a tensor of small values.
ACTIVATION_SCALE_GRID = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)


class _ObservingMethod(LinearMethod):
    """Wraps a layer's method: records max |input| of every apply, otherwise the wrapped
    method's arithmetic. The fused entry points are the base class's, which call this apply on
    the normed input: the tensor a static scale will quantize."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.absmax = 0.0

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            self.absmax = max(self.absmax, float(x.abs().max()))
        return self.inner.apply(layer, ops, x)


class _ScaleSearch(LinearMethod):
    """Wraps a layer's method: for each candidate scale, sums each token's quantization error
    weighted by the weight columns' squared norms, relative to the token's own output (see the
    module's docstring); otherwise the wrapped method's arithmetic."""

    def __init__(self, inner: LinearMethod, candidates: torch.Tensor) -> None:
        self.inner = inner
        self.candidates = candidates  # [C] fp32
        self.error = torch.zeros(len(candidates), dtype=torch.float64)

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        column_weight = layer.weight.detach().float().square().sum(dim=0)  # [in]
        size = (rows.square() @ column_weight).clamp(min=torch.finfo(torch.float32).tiny)
        for i, scale in enumerate(self.candidates.to(x.device)):
            q, s = quantize_fp8(rows, scale)
            err = (q.float() * s - rows).square() @ column_weight  # [tokens]
            self.error[i] += float((err / size).sum())
        return self.inner.apply(layer, ops, x)


def calibrate_input_scales(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
    method: str = "amax",
) -> dict[str, float]:
    """Layer name (as linear_method_factory takes it) -> static input scale, absmax / 448
    ("amax"), or the one of alpha * absmax / 448 (ACTIVATION_SCALE_GRID) with the least output
    error over the same tokens ("mse": a second `run`).

    `run(token_batches)` must run `model`'s forward over every token of every batch, e.g.
    `lambda b: llm.generate(b, SamplingParams(max_tokens=1))` for the `LLM` that holds the model
    (with prefix caching off, or prompts that share no prefix, so that no token is skipped).
    Only prefills are needed, which run eagerly: CUDA graphs, captured before the wrappers, would
    not observe. Every decoder projection must be seen at least once."""
    observers = observe_projections(model, _ObservingMethod, token_batches, run)
    unseen = [name for name, observer in observers.items() if observer.absmax == 0.0]
    if unseen:
        raise ValueError(f"calibration saw no input to {len(unseen)} layers, e.g. {unseen[:3]}")
    scales = {
        name: max(observer.absmax / FP8_E4M3_MAX, FP8_MIN_SCALE)
        for name, observer in observers.items()
    }
    if method == "amax":
        return scales
    if method != "mse":
        raise ValueError(f"activation scales must be one of {ACTIVATION_SCALES}, got {method!r}")
    return search_input_scales(model, token_batches, run, scales)


def search_input_scales(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
    amax_scales: dict[str, float],
) -> dict[str, float]:
    """ "mse": per projection the candidate alpha * amax_scales[name] (ACTIVATION_SCALE_GRID)
    with the least weighted quantization error of its inputs over `run(token_batches)`.
    The model runs unquantized, so every layer sees the source's inputs."""
    grid = torch.tensor(ACTIVATION_SCALE_GRID, dtype=torch.float32)
    searches = observe_projections(
        model, None, token_batches, run,
        named=lambda inner, name: _ScaleSearch(inner, grid * amax_scales[name]),
    )  # fmt: skip
    return {
        name: max(float(search.candidates[int(torch.argmin(search.error))]), FP8_MIN_SCALE)
        for name, search in searches.items()
    }


def observe_projections(
    model: CausalLM,
    make_observer: Callable[[LinearMethod], ObserverT] | None,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
    named: Callable[[LinearMethod, str], ObserverT] | None = None,
) -> dict[str, ObserverT]:
    """Layer name -> the observer that wrapped that decoder projection's method (every Linear
    but the LM head) while `run(token_batches)` ran; the methods are restored afterwards, also
    when `run` raises. `named`, if given, makes the observers instead, from the method and the
    layer's name."""
    wrapped: dict[str, tuple[Linear, ObserverT]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and name != "lm_head":
            observer = make_observer(module.method) if named is None else named(module.method, name)
            wrapped[name] = (module, observer)
            module.method = observer
    try:
        run(token_batches)
    finally:
        for module, observer in wrapped.values():
            module.method = observer.inner
    return {name: observer for name, (_, observer) in wrapped.items()}


class ChannelAmaxObserver(LinearMethod):
    """Wraps a layer's method: keeps each input channel's largest |x| over every apply (fp32, on
    the input's device), otherwise the wrapped method's arithmetic."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.amax: torch.Tensor | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0]:
            amax = rows.abs().amax(dim=0).float()
            self.amax = amax if self.amax is None else torch.maximum(self.amax, amax)
        return self.inner.apply(layer, ops, x)


def calibrate_channel_amax(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
) -> dict[str, torch.Tensor]:
    """Layer name -> [in_features] max |input| per channel, on the CPU, for every decoder
    projection; `run` as calibrate_input_scales takes it (prefills only, prefix caching off)."""
    observers = observe_projections(model, ChannelAmaxObserver, token_batches, run)
    unseen = [name for name, observer in observers.items() if observer.amax is None]
    if unseen:
        raise ValueError(f"calibration saw no input to {len(unseen)} layers, e.g. {unseen[:3]}")
    return {name: observer.amax.cpu() for name, observer in observers.items()}
