"""The mixture-of-experts layer: a router's top-k choice of experts per token and the experts'
gated MLPs as one grouped computation (`ops.fused_moe`: the Triton grouped GEMM on the GPU, the
loop over experts in the reference), behind a method seam as the linear layers' (a method
creates, loads and applies the experts' weights; the model-dtype one here, a quantized one
beside it later). Under tensor or expert parallelism a layer holds its rank's part of the
experts (kiln.layers.moe_parallel.ExpertShard: a slice of each, or whole experts)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType
from typing import TYPE_CHECKING

import torch
from torch import nn

from kiln.kernels.reference import SigmoidRouting

if TYPE_CHECKING:
    from kiln.layers.moe_parallel import ExpertShard


# Up to this many tokens a step reads only the chosen experts' weights (ops.fused_moe_decode:
# GEMVs per (token, slot), no sort by expert, no padding to a GEMM row block); beyond, a grouped
# GEMM over tokens sorted by expert: float8 experts on the float8 tensor cores with per-token
# activation scales (ops.fused_moe_fp8), model-dtype ones in that dtype (ops.fused_moe).
MAX_DECODE_TOKENS = 16


def run_experts(
    ops: ModuleType,
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    w13_scale: torch.Tensor | None = None,  # float8 experts' scales
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,  # gpt-oss's expert biases
    w2_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,  # gpt-oss's clamped SwiGLU (alpha, limit)
    remote_ids: bool = False,  # expert parallelism: ids of -1 name another rank's experts
) -> torch.Tensor:  # [num_tokens, hidden]
    """The experts' kernel for the step's token count (see MAX_DECODE_TOKENS). Steps with other
    ranks' ids (-1) take the grouped kernel at every size (the decode kernels read every id's
    expert); biased or clamped experts (gpt-oss) beyond the decode sizes take it too (the
    float8 grouped kernel runs SiLU(gate) * up without biases). Block-scaled experts (3-D
    scales) take the block grouped GEMM, or the decode GEMVs for a few tokens all of this
    rank's experts."""
    args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if w13_scale is not None and w13_scale.dim() == 3:  # 128x128 blocks (moe_fp8_block.py)
        if w13_bias is not None or w2_bias is not None or swiglu is not None:
            raise ValueError("block-scaled float8 experts take no biases or clamped SwiGLU")
        if x.shape[0] <= MAX_DECODE_TOKENS and not remote_ids:
            return ops.fused_moe_decode(*args)
        return ops.fused_moe_fp8_block(*args)  # takes other ranks' ids (-1) too
    if not remote_ids and x.shape[0] <= MAX_DECODE_TOKENS:
        return ops.fused_moe_decode(*args, w13_bias, w2_bias, swiglu)
    if remote_ids or w13_bias is not None or w2_bias is not None or swiglu is not None:
        return ops.fused_moe(*args, w13_bias, w2_bias, swiglu)
    if w13_scale is not None:
        return ops.fused_moe_fp8(*args)
    return ops.fused_moe(*args)


ExpertWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


class MoEMethod(ABC):
    """A scheme for the experts' weights: create them on the layer and run the routed tokens
    through them (a model-dtype checkpoint's experts are quantized as they load, by the
    families' adapter: kiln.models.moe_blocks.adapt_expert_weights)."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        """Register the experts' parameters (shapes from the layer's sizes)."""

    @abstractmethod
    def expert_weights(self, layer: FusedMoE) -> ExpertWeights:
        """(w13, w2, w13_scale, w2_scale) as the experts' kernels take them (no scales: None)."""

    def expert_zeros(self, layer: FusedMoE) -> tuple[torch.Tensor, torch.Tensor] | None:
        """INT4 experts' (w13, w2) zero points (expert_weights then holds codes and group
        scales); None for float experts."""
        return None

    def apply(
        self,
        layer: FusedMoE,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The routed tokens through expert_weights by run_experts (model-dtype and float8
        experts alike; INT4 experts run their own kernels)."""
        w13, w2, w13_scale, w2_scale = self.expert_weights(layer)
        return run_experts(ops, x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale,
                           *expert_options(layer))  # fmt: skip


class UnquantizedMoEMethod(MoEMethod):
    """Every expert's gate_up ([gate; up] rows) and down weights in the model dtype, stacked
    by expert: w13_weight [E, 2 * inter, hidden], w2_weight [E, hidden, inter]."""

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h, dtype=dtype), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, n, dtype=dtype), requires_grad=False)
        create_expert_biases(layer, dtype)

    def expert_weights(self, layer: FusedMoE) -> ExpertWeights:
        return layer.w13_weight, layer.w2_weight, None, None


def create_expert_biases(layer: FusedMoE, dtype: torch.dtype | None) -> None:
    """w13_bias [E, 2 * inter] and w2_bias [E, hidden] in the model dtype, if the layer has
    biases (gpt-oss); every method's experts take them alike."""
    if layer.has_bias:
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13_bias = nn.Parameter(torch.empty(e, 2 * n, dtype=dtype), requires_grad=False)
        layer.w2_bias = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False)


def expert_options(
    layer: FusedMoE,
) -> tuple[torch.Tensor | None, torch.Tensor | None, tuple[float, float] | None, bool]:
    """run_experts's (w13_bias, w2_bias, swiglu, remote_ids) arguments for the layer."""
    remote = layer.shard is not None and layer.shard.expert_parallel
    if not layer.has_bias:
        return None, None, layer.swiglu, remote
    return layer.w13_bias, layer.w2_bias, layer.swiglu, remote


def quantize_experts_fp8(
    weight: torch.Tensor,  # [num_experts, rows, cols]
    per_channel: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([E, rows, cols] float8 e4m3, [E] or [E, rows] fp32)
    """Each expert's weights in float8 e4m3 with one scale per expert (or, `per_channel`, per
    output row): its absmax / 448."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    dims = (2,) if per_channel else (1, 2)
    amax = weight.detach().abs().amax(dim=dims).float().clamp(min=1e-12)
    scale = amax / fp8_max
    shape = scale.shape + (1,) * (3 - scale.dim())
    scaled = (weight.float() / scale.reshape(shape)).clamp(-fp8_max, fp8_max)
    return scaled.to(torch.float8_e4m3fn), scale


class Fp8MoEMethod(MoEMethod):
    """The experts' weights in float8 e4m3 with a per-expert per-tensor scale each
    (quantization="fp8-dynamic", or "fp8" on dummy weights): half the bytes a decode step
    reads. A model-dtype checkpoint's experts are quantized as they load
    (quantize_experts_fp8); an engine directory holds them quantized. A decode step's few
    tokens widen them to the activations' dtype (weight-only); larger steps quantize the
    activations per token and run the float8 tensor cores. `per_channel`: a scale per output
    row of each expert instead (gpt-oss, whose MXFP4 experts convert to them exactly:
    kiln.checkpoint.fp4_formats)."""

    def __init__(self, per_channel: bool = False) -> None:
        self.per_channel = per_channel

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        fp8 = torch.float8_e4m3fn
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h, dtype=fp8), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, n, dtype=fp8), requires_grad=False)
        rows13, rows2 = ((2 * n,), (h,)) if self.per_channel else ((), ())
        layer.w13_weight_scale = nn.Parameter(torch.ones(e, *rows13), requires_grad=False)
        layer.w2_weight_scale = nn.Parameter(torch.ones(e, *rows2), requires_grad=False)
        create_expert_biases(layer, dtype)

    def expert_weights(self, layer: FusedMoE) -> ExpertWeights:
        return layer.w13_weight, layer.w2_weight, layer.w13_weight_scale, layer.w2_weight_scale


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts of width `intermediate_size`, each token run through the
    `top_k` its router logits pick and their outputs summed by the routing weights. With
    `shard` (TP/EP) the layer holds this rank's part: num_experts and intermediate_size become
    the experts and width it holds, and its output is a part the block sums over the ranks.
    gpt-oss's experts: `bias` on both projections (w13_bias, w2_bias), `swiglu` = (alpha,
    limit) of its clamped activation (reference.clamped_swiglu) in place of SiLU(gate) * up.
    `grouped` = (n_group, topk_group, routed_scaling_factor): DeepSeek-V3's sigmoid routing
    (reference.sigmoid_group_route) with its choice's bias, e_score_correction_bias [E] fp32
    over every expert of the model."""

    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    w13_weight_scale: torch.Tensor  # float8 methods' [E], [E, rows] or [E, rows, K / 128] fp32
    w2_weight_scale: torch.Tensor
    w13_weight_scales: torch.Tensor  # INT4 experts' [E, rows, groups] fp32 (moe_int4.py)
    w2_weight_scales: torch.Tensor
    w13_weight_zeros: torch.Tensor
    w2_weight_zeros: torch.Tensor
    w13_bias: torch.Tensor  # with `bias`: [num_experts, 2 * inter], model dtype
    w2_bias: torch.Tensor  # [num_experts, hidden]
    e_score_correction_bias: torch.Tensor  # with `grouped`: [all experts] fp32

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype | None,
        method: MoEMethod | None = None,
        shard: ExpertShard | None = None,
        bias: bool = False,
        swiglu: tuple[float, float] | None = None,
        grouped: tuple[int, int, float] | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be 1 to num_experts={num_experts}")
        self.grouped = grouped
        if grouped is not None:  # the router's, over every expert whichever this rank holds
            correction = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(correction, requires_grad=False)
        self.shard = shard
        if shard is not None:  # the weights made are this rank's experts and columns
            num_experts, intermediate_size = shard.experts[1], shard.columns[1]
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize = renormalize
        self.has_bias, self.swiglu = bias, swiglu
        self.method = method or UnquantizedMoEMethod()
        self.method.create_weights(self, dtype)

    def forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        # Softmax, top-k, renormalisation, rounding to x's dtype (reference.moe_route), or
        # the sigmoid routing.
        routing = None
        if self.grouped is not None:
            routing = SigmoidRouting(self.e_score_correction_bias, *self.grouped)
        weights, ids = ops.moe_route(router_logits, self.top_k, self.renormalize, x.dtype, routing)
        if self.shard is not None:
            ids = self.shard.local_ids(ids)
        return self.method.apply(self, ops, x, weights, ids)

    def routes_in_experts(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` takes forward_routed: a decode step's few tokens on
        one rank's whole experts, routed by a softmax (the experts' kernel routes no other
        way: sigmoid-routed steps take forward, the router's kernel, then the decode GEMVs)."""
        return self.grouped is None and self.shard is None and num_tokens <= MAX_DECODE_TOKENS

    def forward_routed(
        self,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]: the residual stream, before the norm
        norm_weight: torch.Tensor | None,  # the block's RMSNorm; None: x is the input
        eps: float,
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
        shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # a shared expert's output
        # and its gate's [num_tokens, 1] logits: sigmoid(logits) * output added
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """forward(rms_norm(x), router_logits) where routes_in_experts: the norm, the routing
        and the experts in two launches on the GPU (ops.fused_moe_decode_routed)."""
        w13_bias, w2_bias, swiglu, _ = expert_options(self)
        return ops.fused_moe_decode_routed(
            x, norm_weight, eps, router_logits, self.top_k, self.renormalize,
            *self.method.expert_weights(self), w13_bias, w2_bias, swiglu, shared,
            self.method.expert_zeros(self),
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"inter={self.intermediate_size}, renormalize={self.renormalize}"
            + ("" if self.grouped is None else f", sigmoid groups={self.grouped}")
        )
