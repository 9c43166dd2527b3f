"""FP8 W8A8: float8 e4m3 weights with per-output-channel scales; activations quantized per token
at run time ("dynamic") or with one calibrated per-tensor scale per projection ("static")."""

from __future__ import annotations

import weakref
from types import ModuleType
from typing import Literal

import torch
from torch import nn

from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Fp8Input, FusedOperands, Linear, LinearMethod
from kiln.layers.quantization import RowRounder


class Fp8LinearMethod(LinearMethod):
    """weight [out, in] float8 e4m3 and weight_scale [out] fp32 (row absmax / 448), plus
    input_scale [] fp32 for static activations; the bias stays in the model dtype.

    Each checkpoint tensor is quantized as it arrives (load_weight): a row's scale depends on that
    row alone, so every fused shard (q, k, v; gate, up) quantizes on its own, and loading never
    holds more than one checkpoint tensor in high precision. A staging copy quantized in
    process_weights_after_loading would hold the whole model at the checkpoint's precision first
    (the unquantized peak, twice the float8 model's bytes at bf16) for no difference in result.

    One instance per layer (linear_method_factory makes one per name): it keeps a weak reference
    to its layer to find the scale rows of the shard being loaded.

    The fused kernels take its scales beside its weight (fused_operands), so at batch-1 decode on
    the GPU the norm, the activation quantization, the float8 projection and its epilogue
    (rotary + KV write, SiLU-mul) run as one kernel that reads half bf16's weight bytes; more
    rows run the norm kernel, then quantize + the FP8 GEMM.
    """

    def __init__(
        self,
        activation_scheme: Literal["dynamic", "static"],
        input_scale: float | None = None,
        round_rows: RowRounder | None = None,
        rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        if activation_scheme not in ("dynamic", "static"):
            raise ValueError(
                f"activation_scheme must be dynamic or static, got {activation_scheme!r}"
            )
        if (activation_scheme == "static") != (input_scale is not None):
            raise ValueError("a static activation scheme needs an input_scale; dynamic takes none")
        if input_scale is not None and not input_scale > 0:
            raise ValueError(f"input_scale must be > 0, got {input_scale!r}")
        self.activation_scheme = activation_scheme
        self.static_input_scale = input_scale
        # Rounds whole weight rows (a build's GPTQ, from the layer's input statistics) instead
        # of to nearest; both load paths below quantize whole rows.
        self.round_rows = round_rows
        # Float8 codes [out, in] and scales [out, 1] rounded already (layer-sequential GPTQ,
        # kiln.builder.calibrate.sequential): loaded as they are, the source's weight ignored.
        self.rounded = rounded
        self._layer: weakref.ref[Linear] | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        if self._layer is not None:
            raise RuntimeError("an Fp8LinearMethod serves one layer; make one per layer")
        self._layer = weakref.ref(layer)

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        shape = (layer.out_features, layer.in_features)
        layer.weight = param(torch.empty(shape, dtype=torch.float8_e4m3fn))
        layer.weight_scale = param(torch.ones(layer.out_features, dtype=torch.float32))
        layer.input_scale = None
        if self.static_input_scale is not None:
            layer.input_scale = param(torch.tensor(self.static_input_scale, dtype=torch.float32))
        layer.bias = None
        if layer.has_bias:
            layer.bias = param(torch.empty(layer.out_features, dtype=dtype))

    def load_weight(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        if param.dtype != torch.float8_e4m3fn or loaded.dtype == torch.float8_e4m3fn:
            param.copy_(loaded)  # the bias, a scale, or weights quantized already (an engine)
            return
        layer = self.layer()
        if self.rounded is not None:  # the same rows of the whole weight's rounding
            codes, scale = self.rounded
            self.store_codes(param, layer.shard_view(codes, shard))
            rows = layer.shard_view(scale.view(-1), shard)
            layer.shard_view(layer.weight_scale, shard).copy_(rows)
            return
        # [rows, in] -> float8 rows and their [rows, 1] scales, on the weight's device.
        weight_fp8, scale = self._quantize_rows(loaded.to(param.device))
        self.store_codes(param, weight_fp8)
        layer.shard_view(layer.weight_scale, shard).copy_(scale.view(-1))

    def layer(self) -> Linear:
        """The layer this method serves (alive while its weights load: it holds the method)."""
        layer = None if self._layer is None else self._layer()
        if layer is None:
            raise RuntimeError("this Fp8LinearMethod serves no layer: create_weights never ran")
        return layer

    def store_codes(self, param: torch.Tensor, codes: torch.Tensor) -> None:
        """The weight's rows from their float8 codes (outlier columns append more)."""
        param.copy_(codes)

    def engine_weight(self, codes: torch.Tensor) -> torch.Tensor:
        """The whole weight as an engine stores it, from its float8 codes [out, in]: what a
        row-parallel rank cuts its part from (Linear.cut). The codes themselves here."""
        return codes

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        """Column-parallel: the base class's cut-then-quantize (a row's scale is its own, so a
        rank's rows quantize as at TP=1). Row-parallel: quantize the whole rows first, then keep
        this rank's columns, so every rank's weight bytes and [out] scales equal TP=1's."""
        split = layer.split
        row_parallel = split is not None and split.cols is not None
        if row_parallel and param is layer.weight and loaded.dtype != torch.float8_e4m3fn:
            weight_fp8, scale = self._quantize_rows(loaded.to(param.device))
            param.copy_(layer.cut(param, shard, self.engine_weight(weight_fp8)))
            layer.shard_view(layer.weight_scale, shard).copy_(scale.view(-1))
            return
        super().load_checkpoint_tensor(layer, param, shard, loaded)

    def _quantize_rows(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.round_rows is None:
            return quantize_fp8(weight, None)
        return self.round_rows(weight)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, layer.weight, layer.weight_scale, layer.input_scale, layer.bias)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        return FusedOperands(layer.weight, layer.bias, layer.weight_scale, layer.input_scale)

    def fp8_input(self, layer: Linear) -> Fp8Input | None:
        return Fp8Input(layer.input_scale)

    def apply_fp8(
        self,
        layer: Linear,
        ops: ModuleType,
        x_fp8: torch.Tensor,
        x_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return ops.fp8_matmul(
            x_fp8, x_scale, layer.weight, layer.weight_scale, layer.bias, out_dtype
        )
