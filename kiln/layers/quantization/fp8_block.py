"""FP8 with 128x128 weight blocks (DeepSeek-V3's and Qwen3's FP8 releases, llm-compressor's
FP8_BLOCK): float8 e4m3 weights with one scale per block of 128 outputs x 128 inputs,
activations quantized per token-group of 128 inputs at run time (ops.fp8_block_linear)."""

from __future__ import annotations

import weakref
from types import ModuleType

import torch
from torch import nn

from kiln.errors import ModelLoadError
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
    load as they are; 16-bit weights are rounded per 128x128 block as they arrive (a rank's
    part of them under TP). Tensor parallelism: a column-parallel rank keeps its rows' scales
    (repeated down the full rows first, so a cut inside a block keeps that block's scale); a
    row-parallel rank's input columns must start on a 128-block (refused otherwise) and it keeps
    those blocks' scales."""

    def __init__(self) -> None:
        self._layer: weakref.ref[Linear] | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        split = layer.split
        if split is not None and split.cols is not None:
            start, length = split.cols
            last = split.ctx.tp_rank == split.ctx.tp_size - 1
            if start % FP8_BLOCK or (length % FP8_BLOCK and not last):
                raise ModelLoadError(
                    f"FP8 block-scaled weights: a row-parallel rank's inputs [{start}, "
                    f"{start + length}) split a 128-wide scale block; use a tensor-parallel "
                    "size that leaves each rank a multiple of 128 inputs"
                )
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
        if param is layer.weight_scales:  # one scale per block of 128 rows in the checkpoint
            return (-(-shape[0] // FP8_BLOCK), shape[1])
        return shape

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        if param is layer.weight_scales:
            part = layer.shard_view(param, shard)
            split = layer.split
            rows = part.shape[0]
            if split is not None and split.rows is not None:  # the full rows, cut below
                assert split.full_sizes is not None, "a column-parallel split has its full sizes"
                rows = split.full_sizes[shard] if shard is not None else sum(split.full_sizes)
            part.copy_(layer.cut(param, shard, rows_of(loaded, rows)))
            return
        super().load_checkpoint_tensor(layer, param, shard, loaded)

    def row_parallel_part(
        self, layer: Linear, param: torch.Tensor, loaded: torch.Tensor
    ) -> torch.Tensor | None:
        if param is not layer.weight_scales:
            return None
        start, length = layer.row_parallel_cols()  # on a block boundary (create_weights)
        return loaded.narrow(1, start // FP8_BLOCK, -(-length // FP8_BLOCK))

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
