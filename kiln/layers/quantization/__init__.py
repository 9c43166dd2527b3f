"""Run-time weight quantization schemes, one file each; `linear_method_factory` is the registry:
a scheme's name -> a function giving each projection (by its qualified name) its LinearMethod.
What only a build computes (calibration, GPTQ, smoothing, KV scales) is kiln.builder.calibrate's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Literal

import torch

from kiln.errors import ModelLoadError
from kiln.layers.linear import LinearMethod, UnquantizedLinearMethod

# int4-g128: dummy weights only; the 8-bit ones also round 16-bit weights as they load.
QUANTIZATIONS = ("none", "fp8", "fp8-dynamic", "int4-g128", "int8-w8a8", "fp8-block",
                 "int8-w8a16-channel", "int8-w8a16-g128", "int8-w8a16-g16",
                 "fp8-w8a16-channel")  # fmt: skip
# Weight-only 8-bit, "<int8|fp8>-w8a16-<g<N>|channel>" (pre-quantized checkpoints: any group).
W8A16_PREFIXES = ("int8-w8a16-", "fp8-w8a16-")

# Float8 codes [rows, in] and their scales [rows, 1] of weight rows [rows, in]: how a build
# rounds one projection's weights when not to nearest (kiln.builder.calibrate.gptq).
RowRounder = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def linear_method_factory(
    quantization: str,
    input_scales: Mapping[str, float] | None = None,
    *,
    unquantized: Collection[str] = (),
    weight_rounders: Mapping[str, RowRounder] | None = None,
    rounded: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    outlier_channels: Mapping[str, Sequence[int]] | None = None,
    layers: Mapping[str, str] | None = None,
) -> Callable[[str], LinearMethod]:
    """name (e.g. "layers.3.self_attn.qkv_proj") -> a new LinearMethod for that projection.

    "fp8-dynamic": float8 weights, activations scaled per token at run time. "fp8": float8
    weights, activations with static per-tensor scales from `input_scales` (layer name ->
    scale), which `kiln build` calibrates. `unquantized`: layer names kept in the model dtype
    (`kiln build --unquantized-layers`). `weight_rounders` (layer name -> RowRounder): float8
    weights rounded by it as they load instead of to nearest. `rounded` (layer name -> float8
    codes and scales): weights rounded already, loaded as they are. `outlier_channels` (layer
    name -> input channels, outlier_columns.py): those channels carried as a second float8 term.
    `layers` (layer name -> scheme; a GGUF file's integer projections): each layer its own
    scheme's method, a layer not named the model dtype; `quantization` only names them.
    """
    if layers is not None:
        factories = {scheme: linear_method_factory(scheme) for scheme in set(layers.values())}
        return lambda name: (
            factories[layers[name]](name) if name in layers else UnquantizedLinearMethod()
        )
    if quantization.startswith("int4-"):  # a pre-quantized checkpoint's (int4_formats.py)
        return _int4(quantization, unquantized)
    if quantization in ("int8-w8a8", "fp8-block") or quantization.startswith(W8A16_PREFIXES):
        return _eight_bit(quantization, unquantized)
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; known: {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return lambda name: UnquantizedLinearMethod()
    if unquantized:
        quantized = linear_method_factory(
            quantization, input_scales, weight_rounders=weight_rounders, rounded=rounded,
            outlier_channels=outlier_channels,
        )  # fmt: skip
        kept = frozenset(unquantized)
        return lambda name: UnquantizedLinearMethod() if name in kept else quantized(name)
    from kiln.layers.quantization.fp8 import Fp8LinearMethod

    def fp8(
        name: str, scheme: Literal["dynamic", "static"], input_scale: float | None = None
    ) -> LinearMethod:
        if outlier_channels is not None and name not in outlier_channels:
            raise ModelLoadError(f"outlier columns: no chosen channels for layer {name!r}")
        if weight_rounders is not None and name not in weight_rounders:
            raise ModelLoadError(f"weight rounding: no rounder for layer {name!r}")
        if rounded is not None and name not in rounded:
            raise ModelLoadError(f"layer-sequential GPTQ: no rounded weights for {name!r}")
        round_rows = None if weight_rounders is None else weight_rounders[name]
        codes = None if rounded is None else rounded[name]
        if outlier_channels is None:
            return Fp8LinearMethod(scheme, input_scale, round_rows, codes)
        from kiln.layers.quantization.outlier_columns import OutlierColumnsFp8LinearMethod

        return OutlierColumnsFp8LinearMethod(
            scheme, input_scale, round_rows, codes, channels=outlier_channels[name]
        )

    if quantization == "fp8-dynamic":
        return lambda name: fp8(name, "dynamic")
    if input_scales is None:  # a loading error: the CLI prints it as one line
        raise ModelLoadError(
            'quantization "fp8" uses static activation scales calibrated on sample text: build '
            'an engine with `kiln build --quantization fp8` and load it, or use "fp8-dynamic"'
        )
    scales = input_scales

    def static(name: str) -> LinearMethod:
        if name not in scales:
            raise ModelLoadError(
                f'quantization "fp8": no calibrated input scale for layer {name!r}'
            )
        return fp8(name, "static", scales[name])

    return static


def _int4(quantization: str, unquantized: Collection[str]) -> Callable[[str], LinearMethod]:
    """ "int4-g<group size>" or "int4-channel", with zero points; "-sym" after it: without
    (every zero point 8); "-min": a min per group in weight units instead (GGUF's blocks)."""
    from kiln.layers.quantization.int4 import Int4LinearMethod

    group = quantization.removeprefix("int4-")
    symmetric, mins = group.endswith("-sym"), group.endswith("-min")
    group = group.removesuffix("-sym").removesuffix("-min")
    if group != "channel" and not (group.startswith("g") and group[1:].isdigit()):
        raise ValueError(f"unknown quantization {quantization!r}: int4-g<N> or int4-channel")
    size = 0 if group == "channel" else int(group[1:])
    kept = frozenset(unquantized)

    def method(name: str) -> LinearMethod:
        if name in kept:
            return UnquantizedLinearMethod()
        return Int4LinearMethod(size, needs_zeros=not symmetric, zero_is_min=mins)

    return method


def _eight_bit(quantization: str, unquantized: Collection[str]) -> Callable[[str], LinearMethod]:
    """W8A8 INT8 ("int8-w8a8"), FP8 with 128x128 weight blocks ("fp8-block"), weight-only
    int8 / float8 ("int8-w8a16-g128", "fp8-w8a16-channel", ...; eight_bit_formats.py; "-min"
    after the group: a min per group too, GGUF's blocks)."""
    kept = frozenset(unquantized)

    def make() -> LinearMethod:
        if quantization == "int8-w8a8":
            from kiln.layers.quantization.int8 import Int8LinearMethod

            return Int8LinearMethod()
        if quantization == "fp8-block":
            from kiln.layers.quantization.fp8_block import Fp8BlockLinearMethod

            return Fp8BlockLinearMethod()
        from kiln.layers.quantization.w8a16 import W8A16LinearMethod

        return W8A16LinearMethod(weight_dtype, size, mins)

    weight_dtype, _, group = quantization.partition("-w8a16-")
    mins = group.endswith("-min")
    group = group.removesuffix("-min")
    size = 0
    if quantization.startswith(W8A16_PREFIXES):
        if group != "channel" and not (group.startswith("g") and group[1:].isdigit()):
            raise ValueError(
                f"unknown quantization {quantization!r}: {weight_dtype}-w8a16-g<N> or "
                f"{weight_dtype}-w8a16-channel"
            )
        size = 0 if group == "channel" else int(group[1:])

    def method(name: str) -> LinearMethod:
        return UnquantizedLinearMethod() if name in kept else make()

    return method
