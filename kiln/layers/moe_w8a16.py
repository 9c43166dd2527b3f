"""Mixture-of-experts weights in 8 bits, weight-only (W8A16): int8 or float8 e4m3 codes with a
scale per expert and output channel (int8 also per 128 inputs), the experts of
compressed-tensors W8A16 checkpoints (llm-compressor's `pack-quantized` int8, its float8
weight-only `naive-quantized`) and the weights of its W8A8 INT8 ones (`int-quantized`; their
activations stay in the model dtype, so the experts run as W8A16). A code widened to the
activations' dtype is exact (int8 and e4m3 both fit bf16's mantissa), so the float8 experts'
kernels run them: the decode GEMVs read only the chosen experts' bytes (ops.fused_moe_decode,
or with the block's norm and routing inside; groups of 128 as block FP8's per-row scales), a
larger step the weight-only grouped GEMM (ops.fused_moe with scales: the tile's codes widened
before the dot, the sums scaled per column; groups: the codes scaled before it)."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.moe import MAX_DECODE_TOKENS, ExpertWeights, MoEMethod
from kiln.layers.quantization.w8a16 import quantize_groups

if TYPE_CHECKING:
    from kiln.layers.moe import FusedMoE


# W8A16 experts in groups of inputs take groups of this many (the decode GEMVs' block-scaled
# variant reads a scale per row and 128 inputs): llm-compressor's W8A16 preset.
GROUP = 128


def quantize_experts_w8(
    weight: torch.Tensor,  # [num_experts, rows, cols]
    dtype: torch.dtype,  # torch.int8 or torch.float8_e4m3fn
    group_size: int = 0,  # 0: per channel; else GROUP
) -> tuple[torch.Tensor, torch.Tensor]:  # ([E, rows, cols] codes, [E, rows] or [E, rows,
    # cols / group_size] fp32 scales)
    """Each expert's rows rounded per channel (or group) as the dense W8A16's
    (quantize_groups)."""
    e, rows, cols = weight.shape
    codes, scales = quantize_groups(weight.reshape(e * rows, cols), dtype, group_size)
    shape = (e, rows, cols // group_size) if group_size else (e, rows)
    return codes.view(e, rows, cols), scales.view(shape)


class W8A16MoEMethod(MoEMethod):
    """w13_weight [E, 2 * inter, hidden] and w2_weight [E, hidden, inter] int8 (or float8
    e4m3), w13_weight_scale [E, 2 * inter] and w2_weight_scale [E, hidden] fp32: w = code *
    scale; with `group_size` (GROUP, int8 only) [E, rows, inputs / 128]: each row's scale of
    each 128 inputs, the block-scaled float8 experts' layout (their decode GEMVs' variant; the
    weight-only grouped GEMM's ROW_BLOCKS). A model-dtype checkpoint's experts are rounded
    per channel (or group) as they load (quantize_experts_w8), each expert whole before a
    tensor rank's cut. Under tensor parallelism a rank holds gate and up rows [start, start +
    n) with their scales and down's input columns [start, start + n) (groups of 128: whole
    ones only, refused by name otherwise); under expert parallelism whole experts
    (kiln.layers.moe_parallel.ExpertShard). No biases or clamped SwiGLU (gpt-oss ships no
    8-bit integer experts)."""

    def __init__(self, dtype: torch.dtype, group_size: int = 0) -> None:
        if group_size not in (0, GROUP):
            raise ModelLoadError(
                f"8-bit weight-only experts in groups of {group_size} inputs are not supported "
                f"(kiln loads them per output channel or in groups of {GROUP})"
            )
        self.dtype = dtype
        self.group_size = group_size

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        shard = layer.shard
        if self.group_size and shard is not None and not shard.expert_parallel:
            n = layer.intermediate_size
            if n % GROUP:  # each rank's down inputs whole groups (its start too: rank * n)
                raise ModelLoadError(
                    f"8-bit experts in groups of {GROUP} under tensor_parallel_size="
                    f"{shard.ctx.tp_size}: each rank's {n} of the experts' {shard.full_width} "
                    f"down inputs (this rank's from {shard.columns[0]}) split a group of "
                    f"{GROUP} inputs; each rank needs whole groups (another "
                    "tensor_parallel_size, or --enable-expert-parallel)"
                )
        if layer.has_bias or layer.swiglu is not None:
            raise ModelLoadError(
                "8-bit weight-only experts with biases or a clamped SwiGLU are not supported"
            )
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        if self.group_size and (h % GROUP or n % GROUP):
            raise ModelLoadError(
                f"8-bit experts in groups of {GROUP}: hidden {h} and expert width {n} must be "
                f"multiples of {GROUP}"
            )

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        layer.w13_weight = param(torch.zeros(e, 2 * n, h, dtype=self.dtype))
        layer.w2_weight = param(torch.zeros(e, h, n, dtype=self.dtype))
        groups13 = (h // GROUP,) if self.group_size else ()
        groups2 = (n // GROUP,) if self.group_size else ()
        layer.w13_weight_scale = param(torch.ones(e, 2 * n, *groups13))
        layer.w2_weight_scale = param(torch.ones(e, h, *groups2))

    def expert_weights(self, layer: FusedMoE) -> ExpertWeights:
        return layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale

    def apply(
        self,
        layer: FusedMoE,
        ops: ModuleType,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        w13, w2, w13_scale, w2_scale = self.expert_weights(layer)
        args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
        # Expert parallelism's other ranks' ids (-1) take the grouped kernel at every size
        # (the decode GEMVs read every id's expert).
        remote = layer.shard is not None and layer.shard.expert_parallel
        if x.shape[0] <= MAX_DECODE_TOKENS and not remote:
            return ops.fused_moe_decode(*args)
        return ops.fused_moe(*args)  # weight-only: the float8 tensor cores' path is W8A8
