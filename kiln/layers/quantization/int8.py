"""W8A8 INT8 (SmoothQuant's scheme, llm-compressor's `int-quantized`): int8 weights with a
symmetric scale per output channel, activations quantized to int8 per token at run time, an int8
GEMM accumulating in int32 (ops.int8_linear). After a norm or the MLP's activation the input
arrives quantized by that op's kernel (int8_input: add_rms_norm_quant_int8,
silu_and_mul_quant_int8) and only the GEMM runs (ops.int8_matmul). Smoothing, when a tool
applied it, is folded into the weights and norms already: nothing here knows of it."""

from __future__ import annotations

import weakref
from types import ModuleType

import torch
from torch import nn

from kiln.kernels.reference import quantize_int8
from kiln.layers.linear import Linear, LinearMethod


class Int8LinearMethod(LinearMethod):
    """weight [out, in] int8 and weight_scale [out] fp32 (w = code * scale); the bias in the
    model dtype. A checkpoint's int8 codes load as they are; 16-bit weights (dummy ones, or a
    checkpoint loaded with quantization="int8-w8a8") are rounded to nearest per row as they
    arrive, each row's scale its absmax / 127. One instance per layer."""

    def __init__(self) -> None:
        self._layer: weakref.ref[Linear] | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        if self._layer is not None:
            raise RuntimeError("an Int8LinearMethod serves one layer; make one per layer")
        self._layer = weakref.ref(layer)

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        layer.weight = param(torch.zeros(layer.out_features, layer.in_features, dtype=torch.int8))
        layer.weight_scale = param(torch.ones(layer.out_features, dtype=torch.float32))
        layer.bias = None
        if layer.has_bias:
            layer.bias = param(torch.empty(layer.out_features, dtype=dtype))

    def _owner(self) -> Linear:
        layer = None if self._layer is None else self._layer()
        if layer is None:
            raise RuntimeError("this Int8LinearMethod serves no layer: create_weights never ran")
        return layer

    def load_weight(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        if param.dtype != torch.int8 or loaded.dtype == torch.int8:
            param.copy_(loaded)  # the bias, a scale, or a checkpoint's codes
            return
        codes, scale = quantize_int8(loaded.to(param.device))
        param.copy_(codes)
        layer = self._owner()
        layer.shard_view(layer.weight_scale, shard).copy_(scale.view(-1))

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        """Row-parallel 16-bit weights: whole rows are rounded first (a row's scale is its
        absmax), then this rank's columns kept, so every rank's codes and scales equal TP=1's."""
        split = layer.split
        row_parallel = split is not None and split.cols is not None
        if row_parallel and param is layer.weight and loaded.dtype != torch.int8:
            codes, scale = quantize_int8(loaded.to(param.device))
            param.copy_(layer.cut(param, shard, codes))
            layer.shard_view(layer.weight_scale, shard).copy_(scale.view(-1))
            return
        super().load_checkpoint_tensor(layer, param, shard, loaded)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = ops.int8_linear(x2d, layer.weight, layer.weight_scale, layer.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def int8_input(self, layer: Linear) -> bool:
        return True

    def apply_int8(
        self,
        layer: Linear,
        ops: ModuleType,
        x_int8: torch.Tensor,
        x_scale: torch.Tensor,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        return ops.int8_matmul(
            x_int8, x_scale, layer.weight, layer.weight_scale, layer.bias, out_dtype
        )
