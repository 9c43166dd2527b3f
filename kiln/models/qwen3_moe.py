"""Qwen3-MoE: Qwen3's attention block (per-head q/k RMSNorm) with a mixture of SwiGLU experts
as the MLP of every decoder_sparse_step-th layer not in mlp_only_layers (the others a dense
gated MLP of intermediate_size); the router's top-k renormalised with norm_topk_prob. The
per-expert gate/up/down tensors are stacked at load time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.moe_blocks import EXPERT_TENSOR_MAP, SparseMoeBlock, adapt_expert_weights
from kiln.models.qwen3 import QWEN3_LAYER_TENSOR_MAP

QWEN3_MOE_LAYER_TENSOR_MAP: LayerTensorMap = {**QWEN3_LAYER_TENSOR_MAP, **EXPERT_TENSOR_MAP}
QWEN_EXPERT_PARTS = {
    "gate_proj": ("w13_weight", 0),
    "up_proj": ("w13_weight", 1),
    "down_proj": ("w2_weight", 0),
}


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    layer_tensor_map = QWEN3_MOE_LAYER_TENSOR_MAP
    supports_smoothing = False  # the sparse layers have no gate/up projection to fold into
    qk_norm = True

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        index = int(prefix.rsplit(".", 1)[1])  # the whole model's layer index
        mlp = None
        if full.is_sparse_layer(index):
            mlp = SparseMoeBlock(cfg, f"{prefix}.mlp", method, dtype, ctx)
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, qk_norm=self.qk_norm, mlp=mlp)

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        experts = adapt_expert_weights(self, weights, self.config.num_experts, QWEN_EXPERT_PARTS)
        return super().adapt_hf_weights(experts)
