"""Calibrating the float8 KV cache's per-layer scales (folded into the weights by
kiln.models.kv_scales): each layer's largest key and value magnitude over sample text, as the
cache would hold them; rotary mixes each (j, j + head_dim/2) pair of a key by a rotation, so
the pair's norm bounds both rotated elements and is what is kept for keys."""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch

from kiln.builder.calibrate.calibration import WrappingMethod
from kiln.kernels.reference import FP8_E4M3_MAX
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM
from kiln.models.blocks import decoder_layers
from kiln.models.kv_scales import KVScales


def power_of_two_scale(absmax: float) -> float:
    """The smallest power of two s with absmax / s <= 448 (e4m3's largest finite value)."""
    if not absmax > 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(absmax / FP8_E4M3_MAX))


class _KVObserver(WrappingMethod):
    """Wraps a qkv_proj's method: records the key (pair-norm) and value magnitudes its attention
    block writes to the cache for its output (`keys_values`, the block's own account)."""

    def __init__(
        self,
        inner: LinearMethod,
        keys_values: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        self.inner, self.keys_values = inner, keys_values
        self.k_absmax = self.v_absmax = 0.0

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.apply(layer, ops, x)
        if out.numel():
            key, value = self.keys_values(out.reshape(-1, out.shape[-1]))
            half = key.shape[-1] // 2
            pair_norm = torch.hypot(key[..., :half].float(), key[..., half:].float())
            self.k_absmax = max(self.k_absmax, float(pair_norm.max()))
            self.v_absmax = max(self.v_absmax, float(value.float().abs().max()))
        return out


def calibrate_kv_scales(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
) -> KVScales:
    """Each layer's (k_scale, v_scale), powers of two, from `run(token_batches)` over `model`
    (as calibrate_input_scales takes them: prefills only, every token computed)."""
    observers = []
    for layer in decoder_layers(model):
        attn = layer.self_attn
        proj = attn.qkv_proj
        observer = _KVObserver(proj.method, attn.cache_keys_values)
        observers.append((proj, observer))
        proj.method = observer
    try:
        run(token_batches)
    finally:
        for proj, observer in observers:
            proj.method = observer.inner
    if any(o.k_absmax == 0.0 for _, o in observers):
        raise ValueError("calibration saw no keys for some layers")
    return [(power_of_two_scale(o.k_absmax), power_of_two_scale(o.v_absmax)) for _, o in observers]
