"""W8A16: 8-bit weights (int8, or float8 e4m3), activations in the model dtype, the weights
widened in the GEMM's registers (ops.w8a16_linear): half bf16's weight bytes, no activation
rounding ("accuracy first"). llm-compressor's W8A16 (`pack-quantized` int8, groups of 128 or per
channel) and its float8 weight-only schemes (`naive-quantized`) load into it, and so do a GGUF
file's 5-, 6- and 8-bit blocks (kiln.checkpoint.gguf_int), with a min per group where they
have one."""

from __future__ import annotations

import weakref
from types import ModuleType

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE, INT8_MAX
from kiln.layers.linear import Linear, LinearMethod

WEIGHT_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantize_groups(
    weight: torch.Tensor, dtype: torch.dtype, group_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> codes [rows, K] of `dtype` and scales [rows, K / group_size] (group_size 0:
    one per row), each group's absmax over the type's largest code; int8 rounds half to even."""
    rows, k = weight.shape
    groups = weight.float().view(rows, k // (group_size or k), -1)
    top = INT8_MAX if dtype == torch.int8 else FP8_E4M3_MAX
    scale = (groups.abs().amax(dim=-1, keepdim=True) / top).clamp(min=FP8_MIN_SCALE)
    scaled = (groups / scale).clamp(-top, top)
    if dtype == torch.int8:
        scaled = scaled.round()
    return scaled.to(dtype).view(rows, k), scale.view(rows, -1)


class W8A16LinearMethod(LinearMethod):
    """weight [out, in] int8 or float8 e4m3, weight_scales [out, in / group_size] fp32 (one
    column per channel when group_size is 0): w = code * scale; with `mins`, weight_zeros as
    weight_scales too, each group's min in weight units: w = code * scale + min (GGUF's Q5_1 /
    Q5_K blocks; 0 where nothing loads one). A checkpoint's codes load as they are; 16-bit
    weights are rounded per group as they arrive (symmetric: their mins stay 0).

    Under tensor parallelism a column-parallel rank keeps its rows of codes and scales; a
    row-parallel rank its input columns and their groups' scale columns (whole groups, else
    refused; per-channel scales whole), 16-bit weights rounded whole before the cut."""

    def __init__(self, weight_dtype: str, group_size: int, mins: bool = False) -> None:
        if weight_dtype not in WEIGHT_DTYPES:
            raise ValueError(f"weight_dtype must be int8 or fp8, got {weight_dtype!r}")
        if group_size < 0 or group_size % 16:
            raise ValueError(
                f"group_size must be a multiple of 16 (0: per channel), got {group_size}"
            )
        self.dtype = WEIGHT_DTYPES[weight_dtype]
        self.group_size = group_size
        self.weight_unit_mins = mins
        self._layer: weakref.ref[Linear] | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        if layer.split is not None and layer.split.cols is not None and self.group_size:
            layer.row_parallel_groups(self.group_size, "W8A16 weights")  # row-parallel
        if self._layer is not None:
            raise RuntimeError("a W8A16LinearMethod serves one layer; make one per layer")
        self._layer = weakref.ref(layer)
        n, k = layer.out_features, layer.in_features
        group = self.group_size or k
        if k % group:
            raise ModelLoadError(f"W8A16: {k} inputs are not whole groups of {group}")

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        layer.weight = param(torch.zeros(n, k, dtype=self.dtype))
        layer.weight_scales = param(torch.ones(n, k // group, dtype=torch.float32))
        if self.weight_unit_mins:
            layer.weight_zeros = param(torch.zeros(n, k // group, dtype=torch.float32))
        layer.bias = None
        if layer.has_bias:
            layer.bias = param(torch.empty(n, dtype=dtype))

    def load_weight(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        if param.dtype != self.dtype or loaded.dtype == self.dtype:
            param.copy_(loaded)  # the bias, the scales, or a checkpoint's codes
            return
        layer = None if self._layer is None else self._layer()
        assert layer is not None, "create_weights ran"
        codes, scales = quantize_groups(loaded.to(param.device), self.dtype, self.group_size)
        param.copy_(codes)
        layer.shard_view(layer.weight_scales, shard).copy_(scales)

    def cut(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> torch.Tensor:
        split = layer.split
        row_parallel = split is not None and split.cols is not None
        scales = param is layer.weight_scales or (
            self.weight_unit_mins and param is layer.weight_zeros
        )
        if row_parallel and scales and self.group_size:
            return loaded.narrow(1, *layer.row_parallel_groups(self.group_size, "W8A16 weights"))
        return layer.standard_cut(param, shard, loaded)  # per-channel scales: whole rows

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        """Row-parallel 16-bit weights: whole rows rounded first (a per-channel scale is a
        row's absmax), then this rank's columns and scale columns kept, as at TP=1."""
        split = layer.split
        row_parallel = split is not None and split.cols is not None
        if row_parallel and param is layer.weight and loaded.dtype != self.dtype:
            codes, scales = quantize_groups(loaded.to(param.device), self.dtype, self.group_size)
            param.copy_(layer.cut(param, shard, codes))
            layer.weight_scales.copy_(layer.cut(layer.weight_scales, shard, scales))
            return
        super().load_checkpoint_tensor(layer, param, shard, loaded)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        mins = layer.weight_zeros if self.weight_unit_mins else None
        y = ops.w8a16_linear(x2d, layer.weight, layer.weight_scales, layer.bias, mins)
        return y.reshape(*x.shape[:-1], y.shape[-1])
