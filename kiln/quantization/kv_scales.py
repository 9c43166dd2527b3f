"""Per-layer scales for the float8 KV cache, folded into the weights so the kernels never see them.

A float8 e4m3 cache holds keys and values up to +-448 with ~2 significant digits; unscaled, a
layer whose keys reach past 448 saturates and one whose values stay small spends the format's
range on nothing. With per-layer scales (k_scale, v_scale) the cache holds k / k_scale and
v / v_scale, and attention computes with them as if they were k and v:

  q . k        = (q . (k / k_scale)) * k_scale   -> the layer's softmax scale times k_scale
  sum p v      = (sum p (v / v_scale)) * v_scale -> o_proj's weight times v_scale

and k / k_scale, v / v_scale come from the qkv projection with its k and v rows divided by the
scales (rotary is a rotation of pairs: it commutes with a scalar). So a scaled cache costs no
kernel a single instruction: the scales live in qkv_proj's k/v rows (their float8 weight scales,
or their bf16 weights), o_proj (the same) and each layer's softmax scale. The scales are powers
of two, so folding them into bf16 weights changes no mantissa bit: a model with folded scales and
a bf16 cache computes exactly what the unfolded model does.

Calibration keeps each layer's largest post-rotary key and value magnitude over sample text;
rotary mixes each (j, j + head_dim/2) pair by a rotation, so the pair's norm bounds both
rotated elements and is what is kept for keys.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from types import ModuleType

import torch

from kiln.kernels.reference import FP8_E4M3_MAX
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM

KVScales = list[tuple[float, float]]  # per decoder layer: (k_scale, v_scale)


def power_of_two_scale(absmax: float) -> float:
    """The smallest power of two s with absmax / s <= 448 (e4m3's largest finite value)."""
    if not absmax > 0:
        return 1.0
    return 2.0 ** math.ceil(math.log2(absmax / FP8_E4M3_MAX))


class _KVObserver(LinearMethod):
    """Wraps a qkv_proj's method: records its output's key (pair-norm) and value magnitudes."""

    def __init__(self, inner: LinearMethod, q_size: int, kv_size: int, head_dim: int) -> None:
        self.inner, self.q_size, self.kv_size, self.head_dim = inner, q_size, kv_size, head_dim
        self.k_absmax = self.v_absmax = 0.0

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        out = self.inner.apply(layer, ops, x)
        if out.numel():
            q, kv = self.q_size, self.kv_size
            k = out[..., q : q + kv].float().reshape(-1, kv // self.head_dim, self.head_dim)
            half = self.head_dim // 2
            pair_norm = torch.hypot(k[..., :half], k[..., half:])
            self.k_absmax = max(self.k_absmax, float(pair_norm.max()))
            self.v_absmax = max(self.v_absmax, float(out[..., q + kv :].abs().max()))
        return out


def calibrate_kv_scales(
    model: CausalLM,
    token_batches: list[list[int]],
    run: Callable[[list[list[int]]], object],
) -> KVScales:
    """Each layer's (k_scale, v_scale), powers of two, from `run(token_batches)` over `model`
    (as calibrate_input_scales takes them: prefills only, every token computed)."""
    observers = []
    for layer in model.layers:
        attn = layer.self_attn
        proj = attn.qkv_proj
        observer = _KVObserver(proj.method, attn.q_size, attn.kv_size, attn.head_dim)
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


@torch.no_grad()
def fold_kv_scales(model: CausalLM, scales: KVScales, into_weights: bool = True) -> None:
    """Make `model` write k / k_scale and v / v_scale into its cache and attend as before.
    `into_weights=False`: the weights hold the scales already (an engine built with them), so
    only the softmax scales change."""
    if len(scales) != len(model.layers):
        raise ValueError(f"{len(scales)} KV scales for {len(model.layers)} layers")
    for layer, (k_scale, v_scale) in zip(model.layers, scales):
        attn = layer.self_attn
        attn.scale *= k_scale
        if not into_weights:
            continue
        q, kv = attn.q_size, attn.kv_size
        qkv, o_proj = attn.qkv_proj, attn.o_proj
        _scale_rows(qkv, slice(q, q + kv), 1.0 / k_scale)
        _scale_rows(qkv, slice(q + kv, q + 2 * kv), 1.0 / v_scale)
        _scale_rows(o_proj, slice(None), v_scale, bias=False)  # W (v_stored * s) + b
        if getattr(o_proj, "input_scale", None) is not None:
            o_proj.input_scale.div_(v_scale)  # its static scale saw the unscaled inputs


def _scale_rows(layer: Linear, rows: slice, factor: float, bias: bool = True) -> None:
    """Multiply output rows `rows` of `layer`'s weight by `factor` (through its float8 weight
    scales when it has them), and of its bias with `bias`."""
    scale = getattr(layer, "weight_scale", None)
    target = scale if scale is not None else layer.weight
    target[rows] *= factor
    if bias and layer.bias is not None:
        layer.bias[rows] *= factor
