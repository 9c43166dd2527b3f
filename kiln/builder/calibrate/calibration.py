"""Static activation scales for "fp8": run the unquantized model over sample tokens and keep
each projection's largest input magnitude; its scale is absmax / 448, so the largest value seen
maps to e4m3's largest (larger ones at run time saturate). Every observer here wraps a
projection's linear method while the model's own forward runs (its blocks, not a copy)."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import TypeVar

import torch

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM


class WrappingMethod(LinearMethod):
    """A build-time method that wraps a built layer's own (`inner`) for a pass over calibration
    text, observing or rounding from its inputs; the layer gets `inner` back afterwards."""

    inner: LinearMethod

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")


ObserverT = TypeVar("ObserverT", bound=WrappingMethod)


class _ObservingMethod(WrappingMethod):
    """Wraps a layer's method: records max |input| of every apply, otherwise the wrapped
    method's arithmetic. It offers the blocks no fused operands, so they run the norm, then this
    apply on the normed input: the tensor a static scale will quantize."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.absmax = 0.0

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if x.numel():
            self.absmax = max(self.absmax, float(x.abs().max()))
        return self.inner.apply(layer, ops, x)


def calibrate_input_scales(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
) -> dict[str, float]:
    """Layer name (as linear_method_factory takes it) -> static input scale, absmax / 448.

    `run(token_batches)` must run `model`'s forward over every token of every batch, e.g.
    `lambda b: llm.generate(b, SamplingParams(max_tokens=1))` for the `LLM` that holds the model
    (with prefix caching off, or prompts that share no prefix, so that no token is skipped).
    Only prefills are needed, which run eagerly: CUDA graphs, captured before the wrappers, would
    not observe. Every decoder projection must be seen at least once."""
    observers = observe_projections(model, _ObservingMethod, token_batches, run)
    unseen = [name for name, observer in observers.items() if observer.absmax == 0.0]
    if unseen:
        raise ValueError(f"calibration saw no input to {len(unseen)} layers, e.g. {unseen[:3]}")
    return {
        name: max(observer.absmax / FP8_E4M3_MAX, FP8_MIN_SCALE)
        for name, observer in observers.items()
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
        if isinstance(module, Linear) and name != "lm_head" and module.applied:
            if named is not None:
                observer = named(module.method, name)
            else:
                assert make_observer is not None, "observe_projections takes one of the two"
                observer = make_observer(module.method)
            wrapped[name] = (module, observer)
            module.method = observer
    try:
        run(token_batches)
    finally:
        for module, observer in wrapped.values():
            module.method = observer.inner
    return {name: observer for name, (_, observer) in wrapped.items()}


class ChannelAmaxObserver(WrappingMethod):
    """Wraps a layer's method: keeps each input channel's largest |x| over every apply (fp32, on
    the input's device), otherwise the wrapped method's arithmetic."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.amax: torch.Tensor | None = None

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
    return {name: o.amax.cpu() for name, o in observers.items() if o.amax is not None}
