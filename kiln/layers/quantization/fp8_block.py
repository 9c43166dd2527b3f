"""FP8 with 128x128 weight blocks (DeepSeek-V3's and Qwen3's FP8 releases, llm-compressor's
FP8_BLOCK): float8 e4m3 weights with one scale per block of 128 outputs x 128 inputs,
activations quantized per token-group of 128 inputs at run time (ops.fp8_block_linear)."""

from __future__ import annotations

import weakref
from types import ModuleType

import torch
from torch import nn

from kiln.kernels.reference import FP8_BLOCK, FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.layers.linear import Linear, LinearMethod


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, K] -> float8 codes [rows, K] and each row's block scales [rows, ceil(K / 128)]:
    each 128x128 block (the last ones partial) scaled by its absmax / 448."""
    rows, k = weight.shape
    rb, kb = -(-rows // FP8_BLOCK), -(-k // FP8_BLOCK)
    w = torch.nn.functional.pad(weight.float(), (0, kb * FP8_BLOCK - k, 0, rb * FP8_BLOCK - rows))
    blocks = w.view(rb, FP8_BLOCK, kb, FP8_BLOCK)
    scale = (blocks.abs().amax(dim=(1, 3), keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    codes = (blocks / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    codes = codes.view(rb * FP8_BLOCK, kb * FP8_BLOCK)[:rows, :k]
    return codes, rows_of(scale.view(rb, kb), rows)


def rows_of(block_scales: torch.Tensor, rows: int) -> torch.Tensor:
    """[ceil(rows / 128), KB] block scales -> [rows, KB]: each row's scale of each K block."""
    return block_scales.float().repeat_interleave(FP8_BLOCK, dim=0)[:rows]


class Fp8BlockLinearMethod(LinearMethod):
    """weight [out, in] float8 e4m3, weight_scales [out, ceil(in / 128)] fp32: the checkpoint's
    [ceil(rows / 128), ceil(in / 128)] block scales of each fused shard repeated down the shard's
    rows (so q, k and v keep their own blocks wherever their rows start). A checkpoint's codes
    load as they are; 16-bit weights are rounded per 128x128 block as they arrive.

    Under tensor parallelism a column-parallel rank keeps its rows of the codes and of the
    per-row scales (any cut: each row carries its blocks' scales); a row-parallel rank its input
    columns and their blocks' scale columns, which must be whole 128-blocks (its activation
    groups then are TP=1's). 16-bit weights are rounded whole, then cut, so every rank's codes
    and scales are the one-process model's."""

    def __init__(self) -> None:
        self._layer: weakref.ref[Linear] | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        if layer.split is not None and layer.split.cols is not None:  # row-parallel
            layer.row_parallel_groups(FP8_BLOCK, "FP8 block-scaled weights")
        if self._layer is not None:
            raise RuntimeError("an Fp8BlockLinearMethod serves one layer; make one per layer")
        self._layer = weakref.ref(layer)

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        n, k = layer.out_features, layer.in_features
        layer.weight = param(torch.zeros(n, k, dtype=torch.float8_e4m3fn))
        layer.weight_scales = param(torch.ones(n, -(-k // FP8_BLOCK), dtype=torch.float32))
        layer.bias = None
        if layer.has_bias:
            layer.bias = param(torch.empty(n, dtype=dtype))

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        # One scale per block of 128 rows in the checkpoint; under TP the cut is per row (cut).
        if param is layer.weight_scales and layer.split is None:
            return (-(-shape[0] // FP8_BLOCK), shape[1])
        return shape

    def cut(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> torch.Tensor:
        if param is not layer.weight_scales:
            return layer.standard_cut(param, shard, loaded)
        split = layer.split
        assert split is not None, "Linear.cut cuts only under a split"
        if split.rows is None:  # row-parallel: every row
            rows = layer.shard_view(param, shard).shape[0]
        else:
            assert split.full_sizes is not None, "a column-parallel split has its full sizes"
            rows = split.full_sizes[shard] if shard is not None else sum(split.full_sizes)
        if loaded.shape[0] != rows:  # a checkpoint's [row blocks, K blocks]; an engine's per row
            loaded = rows_of(loaded, rows)
        if split.cols is None:
            return layer.standard_cut(param, shard, loaded)
        return loaded.narrow(1, *layer.row_parallel_groups(FP8_BLOCK, "FP8 block-scaled weights"))

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        if param is layer.weight_scales:
            part = layer.shard_view(param, shard)
            if layer.split is None:
                part.copy_(rows_of(loaded, part.shape[0]))
            else:
                part.copy_(layer.cut(param, shard, loaded))
            return
        if layer.split is not None and param is layer.weight and loaded.dtype != param.dtype:
            # Whole blocks rounded first, then this rank's part of codes and scales.
            codes, scales = quantize_blocks(loaded.to(param.device))
            layer.shard_view(param, shard).copy_(layer.cut(param, shard, codes))
            scale_part = layer.shard_view(layer.weight_scales, shard)
            scale_part.copy_(layer.cut(layer.weight_scales, shard, scales))
            return
        super().load_checkpoint_tensor(layer, param, shard, loaded)

    def load_weight(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        if param.dtype != torch.float8_e4m3fn or loaded.dtype == torch.float8_e4m3fn:
            param.copy_(loaded)
            return
        layer = None if self._layer is None else self._layer()
        assert layer is not None, "create_weights ran"
        codes, scales = quantize_blocks(loaded.to(param.device))
        param.copy_(codes)
        layer.shard_view(layer.weight_scales, shard).copy_(scales)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, x.shape[-1])
        y = ops.fp8_block_linear(x2d, layer.weight, layer.weight_scales, layer.bias)
        return y.reshape(*x.shape[:-1], y.shape[-1])
