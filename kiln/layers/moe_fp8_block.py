"""Mixture-of-experts weights in FP8 with 128x128 block scales (DeepSeek-V3's and Qwen3's FP8
releases, llm-compressor's FP8_BLOCK, `kiln build --quantization fp8-block`): the experts'
float8 codes and each row's scale of each block of 128 inputs, the dense projections' layout
(kiln.layers.quantization.fp8_block) stacked by expert. Prefill runs the block-scaled grouped
GEMM on float8 activations per token-group of 128 (ops.fused_moe_fp8_block), decode the GEMVs
reading only the chosen experts with the scales applied to the widened codes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.kernels.reference import FP8_BLOCK
from kiln.layers.moe import ExpertWeights, MoEMethod
from kiln.layers.quantization.fp8_block import quantize_blocks

if TYPE_CHECKING:
    from kiln.layers.moe import FusedMoE


def quantize_experts_fp8_block(
    weight: torch.Tensor,  # [num_experts, rows, cols]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([E, rows, cols] float8 e4m3, [E, rows, KB] fp32)
    """Each expert rounded per 128x128 block (quantize_blocks): float8 codes and each row's
    scale of each block of 128 columns."""
    pairs = [quantize_blocks(w) for w in weight]
    return torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])


class Fp8BlockMoEMethod(MoEMethod):
    """w13_weight [E, 2 * inter, hidden] and w2_weight [E, hidden, inter] float8 e4m3,
    w13_weight_scale [E, 2 * inter, ceil(hidden / 128)] and w2_weight_scale [E, hidden,
    ceil(inter / 128)] fp32: each row's scale of each input block (the checkpoint's 128x128
    block scales repeated down their rows, so gate and up keep their own blocks wherever up's
    rows start). Tensor parallelism cuts w2's inputs at whole blocks only: each rank's
    intermediate width a multiple of 128 (refused otherwise); expert parallelism takes whole
    experts at any count. No biases or clamped SwiGLU (gpt-oss's experts)."""

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        if layer.has_bias or layer.swiglu is not None:
            raise ModelLoadError("FP8 block-scaled experts with biases (gpt-oss) are not supported")
        shard = layer.shard
        n = layer.intermediate_size
        if shard is not None and not shard.expert_parallel and n % FP8_BLOCK:
            raise ModelLoadError(
                f"FP8 block-scaled experts: moe_intermediate_size {shard.full_width} over "
                f"{shard.ctx.tp_size} tensor ranks gives each {n} columns, which splits a "
                f"128-wide scale block; use a tensor-parallel size that leaves each rank a "
                "multiple of 128, or --enable-expert-parallel"
            )
        e, h = layer.num_experts, layer.hidden_size
        fp8 = torch.float8_e4m3fn

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        layer.w13_weight = param(torch.zeros(e, 2 * n, h, dtype=fp8))
        layer.w2_weight = param(torch.zeros(e, h, n, dtype=fp8))
        layer.w13_weight_scale = param(torch.ones(e, 2 * n, -(-h // FP8_BLOCK)))
        layer.w2_weight_scale = param(torch.ones(e, h, -(-n // FP8_BLOCK)))

    def expert_weights(self, layer: FusedMoE) -> ExpertWeights:
        return layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale
