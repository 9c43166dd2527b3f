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
    from kiln.layers.moe_parallel import ExpertShard


class Int4MoEMethod(MoEMethod):
    """w13_weight [E, 2 * inter, hidden / 8] and w2_weight [E, hidden, inter / 8] int32 (8
    codes a word, code 8j + i of a row at bits 4i of word j), w13_weight_scales / _zeros [E,
    2 * inter, hidden / group] and w2_weight_scales / _zeros [E, hidden, inter / group] fp32:
    w = (code - zero) * scale. Zeros stay 8 (symmetric) where a checkpoint holds none.
    Under tensor parallelism a rank holds every expert's gate and up rows [start, start + n)
    with their scales and zeros, and down's input columns [start, start + n): its words from
    start / 8, its groups from start / group_size, whole groups only (refused by name
    otherwise; per-channel scales whole); under expert parallelism whole experts
    (kiln.layers.moe_parallel.ExpertShard cuts them). Act-order (GPTQ desc_act) experts are
    refused at any size (kiln.models.moe_blocks)."""

    def __init__(self, group_size: int, needs_zeros: bool = True) -> None:
        self.group_size = group_size  # 0: one group of all inputs (per channel)
        self.needs_zeros = needs_zeros  # False: symmetric, no zero points in the checkpoint

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        if layer.shard is not None and not layer.shard.expert_parallel:
            self._check_whole_groups(layer.shard, layer.intermediate_size)
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

    def _check_whole_groups(self, shard: ExpertShard, width: int) -> None:
        """Under tensor parallelism each rank's down inputs [start, start + width) must be
        whole groups (a partial sum over part of a group would need another rank's scale)
        and whole words of 8 codes."""
        group = self.group_size or 8  # per channel: one scale a row serves any cut
        start = shard.columns[0]
        if start % group or width % group:
            raise ModelLoadError(
                f"INT4 experts under tensor_parallel_size={shard.ctx.tp_size}: each rank's "
                f"{width} of the experts' {shard.full_width} down inputs (this rank's from "
                f"{start}) split a group of {group} inputs; each rank needs whole groups "
                "(another tensor_parallel_size, or --enable-expert-parallel)"
            )

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
        # Expert parallelism's other ranks' ids (-1) take the grouped kernel at every size
        # (the decode GEMVs read every id's expert).
        remote = layer.shard is not None and layer.shard.expert_parallel
        if x.shape[0] <= MAX_DECODE_TOKENS and not remote:
            return ops.fused_moe_int4_decode(*args)
        return ops.fused_moe_int4(*args)
