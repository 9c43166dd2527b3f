"""Weight quantization schemes, one file each; `linear_method_factory` is the registry: a scheme's
name -> a function giving each projection (by its qualified name) its LinearMethod."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import torch

from kiln.errors import ModelLoadError
from kiln.layers.linear import LinearMethod, UnquantizedLinearMethod

QUANTIZATIONS = ("none", "fp8", "fp8-dynamic")


def linear_method_factory(
    quantization: str,
    input_scales: Mapping[str, float] | None = None,
    hessians: dict[str, torch.Tensor] | None = None,
    unquantized: Collection[str] = (),
    crosses: dict[str, torch.Tensor] | None = None,
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    outlier_channels: Mapping[str, Sequence[int]] | None = None,
) -> Callable[[str], LinearMethod]:
    """name (e.g. "layers.3.self_attn.qkv_proj") -> a new LinearMethod for that projection.

    "fp8-dynamic": float8 weights, activations scaled per token at run time. "fp8": float8
    weights, activations with static per-tensor scales from `input_scales` (layer name ->
    scale, as calibrate_input_scales makes them), which `kiln build` calibrates. `hessians`
    (layer name -> input statistics, as kiln.quantization.gptq.calibrate_hessians makes them):
    float8 weights rounded by GPTQ instead of to nearest. `unquantized`: layer names kept in
    the model dtype (`kiln build --unquantized-layers`). `crosses` (layer name -> X Xq^T, with
    `hessians` then Xq Xq^T): GPTQ of the activation-aware target (kiln.quantization.gptq).
    `rounded` (layer name -> float8 codes and scales, kiln.quantization.sequential): weights
    rounded already, loaded as they are. `outlier_channels` (layer name -> input channels,
    kiln.quantization.outlier_columns): those channels carried as a second float8 term."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(
            f"unknown quantization {quantization!r}; known: {', '.join(QUANTIZATIONS)}"
        )
    if quantization == "none":
        return lambda name: UnquantizedLinearMethod()
    if unquantized:
        quantized = linear_method_factory(
            quantization, input_scales, hessians, (), crosses, rounded, outlier_channels
        )
        kept = frozenset(unquantized)
        return lambda name: UnquantizedLinearMethod() if name in kept else quantized(name)
    from kiln.quantization.fp8 import Fp8LinearMethod

    def hessian(name: str) -> torch.Tensor | None:
        if hessians is None:
            return None
        if name not in hessians:
            raise ModelLoadError(f"GPTQ rounding: no calibrated input statistics for {name!r}")
        return hessians[name]

    def rounding(name: str) -> dict:
        if rounded is not None and name not in rounded:
            raise ModelLoadError(f"layer-sequential GPTQ: no rounded weights for {name!r}")
        return {
            "hessian": hessian(name),
            "cross": None if crosses is None else crosses[name],
            "rounded": None if rounded is None else rounded[name],
        }

    def fp8(name: str, *args: object) -> LinearMethod:
        if outlier_channels is None:
            return Fp8LinearMethod(*args, **rounding(name))
        from kiln.quantization.outlier_columns import OutlierColumnsFp8LinearMethod

        if name not in outlier_channels:
            raise ModelLoadError(f"outlier columns: no chosen channels for layer {name!r}")
        return OutlierColumnsFp8LinearMethod(
            *args, channels=outlier_channels[name], **rounding(name)
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
