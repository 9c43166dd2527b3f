"""Per-layer scales of the float8 KV cache, folded into the weights so the kernels never see them.

A float8 e4m3 cache holds keys and values up to +-448 with ~2 significant digits; unscaled, a
layer whose keys reach past 448 saturates and one whose values stay small spends the format's
range on nothing. With per-layer scales (k_scale, v_scale) the cache holds k / k_scale and
v / v_scale, and attention computes with them as if they were k and v:

  q . k        = (q . (k / k_scale)) * k_scale   -> the layer's softmax scale times k_scale
  sum p v      = (sum p (v / v_scale)) * v_scale -> o_proj's weight times v_scale

Where k / k_scale and v / v_scale come from is the attention block's to say
(RopeAttention.fold_kv_scales): the qkv projection's k and v rows divided by the scales (rotary
is a rotation of pairs: it commutes with a scalar), or, after a per-head k-norm that would undo a
scale folded before it, the norm's weight (RMSNorm(k) * w / s == RMSNorm(k) * (w / s)). So a
scaled cache costs no kernel a single instruction. The scales are powers of two, so folding them
into bf16 weights changes no mantissa bit: a model with folded scales and a bf16 cache computes
exactly what the unfolded model does.

An int8 cache (127 levels, no exponent) wants a scale per KV head rather than per layer:
KVHeadScales, folded by RopeAttention.fold_kv_head_scales (the k scale through the query rows
of its group, the v scale through o_proj's input columns of its group, where the weights allow).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kiln.models.base import CausalLM

KVScales = list[tuple[float, float]]  # per decoder layer: (k_scale, v_scale)
# Per decoder layer: (k scale per KV head, v scale per KV head), the whole model's heads.
KVHeadScales = list[tuple[list[float], list[float]]]


class KVScaleFoldError(ValueError):
    """An attention block that cannot take a KV-cache scale, and why."""


@torch.no_grad()
def fold_kv_scales(
    model: CausalLM, scales: Sequence[tuple[float, float]], into_weights: bool = True
) -> None:
    """Make `model` write k / k_scale and v / v_scale into its cache and attend as before, each
    layer's attention block folding them where its shape allows (KVScaleFoldError where it
    cannot). `into_weights=False`: the weights hold the scales already (an engine built with
    them), so only the softmax scales change."""
    layers = model.layers
    if len(scales) != len(layers):
        raise ValueError(f"{len(scales)} KV scales for {len(layers)} layers")
    for index, (layer, (k_scale, v_scale)) in enumerate(zip(layers, scales)):
        attention = layer.self_attn
        fold = getattr(attention, "fold_kv_scales", None)
        if fold is None:
            raise KVScaleFoldError(
                f"layer {index}: a {type(attention).__name__} block does not say where a float8 "
                "KV-cache scale folds; run without KV-cache scales (an unscaled float8 cache)"
            )
        fold(k_scale, v_scale, into_weights)


@torch.no_grad()
def fold_kv_head_scales(
    model: CausalLM,
    scales: Sequence[tuple[Sequence[float], Sequence[float]]],
    into_weights: bool = True,
) -> KVHeadScales:
    """fold_kv_scales with a (k, v) scale per KV head of each layer (`scales`: the model's
    layers, or this pipeline stage's). Returns the scales folded, after each block's choices
    (RopeAttention.fold_kv_head_scales: a layer's largest where its shape allows no other), for
    this rank's heads."""
    layers = model.layers
    if len(scales) != len(layers):
        raise ValueError(f"{len(scales)} KV-head scales for {len(layers)} layers")
    folded: KVHeadScales = []
    for index, (layer, (k_scales, v_scales)) in enumerate(zip(layers, scales)):
        attention = layer.self_attn
        fold = getattr(attention, "fold_kv_head_scales", None)
        if fold is None:
            raise KVScaleFoldError(
                f"layer {index}: a {type(attention).__name__} block does not say where an int8 "
                "KV-cache scale folds"
            )
        folded.append(fold(k_scales, v_scales, into_weights))
    return folded
