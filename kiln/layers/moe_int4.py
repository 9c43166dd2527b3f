"""Mixture-of-experts weights in INT4, weight-only (W4A16): the experts of GPTQ, AutoAWQ (GEMM)
and compressed-tensors pack-quantized checkpoints (Qwen3-30B-A3B-GPTQ-Int4, llm-compressor's
W4A16 MoE), each read by the dense INT4 readers (kiln.checkpoint.int4_formats) into the dense
layout (kiln.layers.quantization.int4) and stacked by expert. A decode step's GEMVs read only
the chosen experts' packed words and dequantize them in registers (ops.fused_moe_int4_decode,
or with the block's norm and routing inside: ops.fused_moe_decode_routed's INT4 variant);
a larger step runs the grouped GEMM on the experts it touches (ops.fused_moe_int4)."""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.layers.moe import MAX_DECODE_TOKENS, ExpertWeights, MoEMethod
from kiln.layers.quantization.int4 import DUMMY_SCALE, SYMMETRIC_ZERO

if TYPE_CHECKING:
    from kiln.layers.moe import FusedMoE


class Int4MoEMethod(MoEMethod):
    """w13_weight [E, 2 * inter, hidden / 8] and w2_weight [E, hidden, inter / 8] int32 (8
    codes a word, code 8j + i of a row at bits 4i of word j), w13_weight_scales / _zeros [E,
    2 * inter, hidden / group] and w2_weight_scales / _zeros [E, hidden, inter / group] fp32:
    w = (code - zero) * scale. Zeros stay 8 (symmetric) where a checkpoint holds none."""

    def __init__(self, group_size: int, needs_zeros: bool = True) -> None:
        self.group_size = group_size  # 0: one group of all inputs (per channel)
        self.needs_zeros = needs_zeros  # False: symmetric, no zero points in the checkpoint

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        if layer.shard is not None:
            raise ModelLoadError(
                "INT4 experts run at tensor_parallel_size=1 without expert parallelism: "
                "cutting them per rank is not built yet"
            )
        if layer.has_bias or layer.swiglu is not None:
            raise ModelLoadError("INT4 experts with biases or a clamped SwiGLU are not supported")
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        for name, rows, cols in (("w13", 2 * n, h), ("w2", h, n)):
            group = self.group_size or cols
            if cols % 8 or cols % group:
                raise ModelLoadError(f"INT4 experts: {cols} inputs are not whole groups of {group}")
            words = torch.zeros(e, rows, cols // 8, dtype=torch.int32)
            setattr(layer, f"{name}_weight", nn.Parameter(words, requires_grad=False))
            # A checkpoint's replace these; dummy weights keep them (as the dense INT4's).
            for suffix, value in (("scales", DUMMY_SCALE), ("zeros", SYMMETRIC_ZERO)):
                full = torch.full((e, rows, cols // group), value)
                setattr(layer, f"{name}_weight_{suffix}", nn.Parameter(full, requires_grad=False))

    def expert_weights(self, layer: FusedMoE) -> ExpertWeights:
        return layer.w13_weight, layer.w2_weight, layer.w13_weight_scales, layer.w2_weight_scales

    def expert_zeros(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor] | None:
        return layer.w13_weight_zeros, layer.w2_weight_zeros

    def apply(
        self,
        layer: FusedMoE,
        ops: ModuleType,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        args = (
            x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            layer.w13_weight_scales, layer.w2_weight_scales,
            layer.w13_weight_zeros, layer.w2_weight_zeros,
        )  # fmt: skip
        if x.shape[0] <= MAX_DECODE_TOKENS:
            return ops.fused_moe_int4_decode(*args)
        return ops.fused_moe_int4(*args)
