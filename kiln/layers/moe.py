"""The mixture-of-experts layer: a router's top-k choice of experts per token and the experts'
gated MLPs as one grouped computation (`ops.fused_moe`: the Triton grouped GEMM on the GPU, the
loop over experts in the reference), behind a method seam as the linear layers' (a method
creates, loads and applies the experts' weights; the model-dtype one here, a quantized one
beside it later). Expert parallelism and tensor-parallel expert slices are not built: a model
with experts runs on one tensor rank."""

from __future__ import annotations

from abc import ABC, abstractmethod
from types import ModuleType

import torch
from torch import nn

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
) -> torch.Tensor:  # [num_tokens, hidden]
    """The experts' kernel for the step's token count (see MAX_DECODE_TOKENS)."""
    args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    if x.shape[0] <= MAX_DECODE_TOKENS:
        return ops.fused_moe_decode(*args)
    if w13_scale is not None:
        return ops.fused_moe_fp8(*args)
    return ops.fused_moe(*args)


class MoEMethod(ABC):
    """A scheme for the experts' weights: create them on the layer and run the routed tokens
    through them (a model-dtype checkpoint's experts are quantized as they load, by the
    families' adapter: kiln.models.moe_blocks.adapt_expert_weights)."""

    @abstractmethod
    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        """Register the experts' parameters (shapes from the layer's sizes)."""

    @abstractmethod
    def apply(
        self,
        layer: FusedMoE,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]
        topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
        topk_ids: torch.Tensor,  # [num_tokens, top_k]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        ...


class UnquantizedMoEMethod(MoEMethod):
    """Every expert's gate_up ([gate; up] rows) and down weights in the model dtype, stacked
    by expert: w13_weight [E, 2 * inter, hidden], w2_weight [E, hidden, inter]."""

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h, dtype=dtype), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, n, dtype=dtype), requires_grad=False)

    def apply(
        self,
        layer: FusedMoE,
        ops: ModuleType,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return run_experts(ops, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)


def quantize_experts_fp8(
    weight: torch.Tensor,  # [num_experts, rows, cols]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([E, rows, cols] float8 e4m3, [E] fp32 scales)
    """Each expert's weights in float8 e4m3 with one scale per expert: its absmax / 448."""
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    amax = weight.detach().abs().amax(dim=(1, 2)).float().clamp(min=1e-12)
    scale = amax / fp8_max
    scaled = (weight.float() / scale[:, None, None]).clamp(-fp8_max, fp8_max)
    return scaled.to(torch.float8_e4m3fn), scale


class Fp8MoEMethod(MoEMethod):
    """The experts' weights in float8 e4m3 with a per-expert per-tensor scale each
    (quantization="fp8-dynamic", or "fp8" on dummy weights): half the bytes a decode step
    reads. A model-dtype checkpoint's experts are quantized as they load
    (quantize_experts_fp8); an engine directory holds them quantized. A decode step's few
    tokens widen them to the activations' dtype (weight-only); larger steps quantize the
    activations per token and run the float8 tensor cores."""

    def create_weights(self, layer: FusedMoE, dtype: torch.dtype | None) -> None:
        e, h, n = layer.num_experts, layer.hidden_size, layer.intermediate_size
        fp8 = torch.float8_e4m3fn
        layer.w13_weight = nn.Parameter(torch.empty(e, 2 * n, h, dtype=fp8), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, n, dtype=fp8), requires_grad=False)
        layer.w13_weight_scale = nn.Parameter(torch.ones(e), requires_grad=False)
        layer.w2_weight_scale = nn.Parameter(torch.ones(e), requires_grad=False)

    def apply(
        self,
        layer: FusedMoE,
        ops: ModuleType,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        return run_experts(
            ops, x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
            layer.w13_weight_scale, layer.w2_weight_scale,
        )  # fmt: skip


class FusedMoE(nn.Module):
    """`num_experts` SwiGLU experts of width `intermediate_size`, each token run through the
    `top_k` its router logits pick and their outputs summed by the routing weights."""

    w13_weight: torch.Tensor
    w2_weight: torch.Tensor
    w13_weight_scale: torch.Tensor  # float8 methods' [num_experts] fp32
    w2_weight_scale: torch.Tensor

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        hidden_size: int,
        intermediate_size: int,
        renormalize: bool,
        dtype: torch.dtype | None,
        method: MoEMethod | None = None,
    ) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be 1 to num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize = renormalize
        self.method = method or UnquantizedMoEMethod()
        self.method.create_weights(self, dtype)

    def forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]
        router_logits: torch.Tensor,  # [num_tokens, num_experts]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        # Softmax, top-k, renormalisation, rounding to x's dtype (reference.moe_route).
        weights, ids = ops.moe_route(router_logits, self.top_k, self.renormalize, x.dtype)
        return self.method.apply(self, ops, x, weights, ids)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
            f"inter={self.intermediate_size}, renormalize={self.renormalize}"
        )
