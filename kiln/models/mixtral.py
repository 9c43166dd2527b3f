"""Mixtral: Mistral's attention block with every layer's MLP a mixture of SwiGLU experts
(`block_sparse_moe`: a router over num_local_experts, the top num_experts_per_tok renormalised),
run by kiln.models.moe_blocks.SparseMoeBlock; the per-expert w1 (gate), w3 (up) and w2 (down)
tensors are stacked at load time."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.llama import LAYER_TENSOR_MAP
from kiln.models.moe_blocks import EXPERT_TENSOR_MAP, SparseMoeBlock, adapt_expert_weights

MIXTRAL_LAYER_TENSOR_MAP: LayerTensorMap = {
    **{k: v for k, v in LAYER_TENSOR_MAP.items() if not k.startswith("mlp.")},
    **EXPERT_TENSOR_MAP,
    "block_sparse_moe.gate.weight": ("mlp.gate.weight", None),
}
MIXTRAL_EXPERT_PARTS = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 0)}


class MixtralForCausalLM(DecoderForCausalLM):
    layer_tensor_map = MIXTRAL_LAYER_TENSOR_MAP
    supports_smoothing = False  # no gate/up projection to fold a smoothing into

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        mlp = SparseMoeBlock(cfg, f"{prefix}.mlp", method, dtype, ctx)
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, mlp=mlp)

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        experts = adapt_expert_weights(self, weights, self.config.num_experts, MIXTRAL_EXPERT_PARTS)
        return super().adapt_hf_weights(experts)
