"""OLMo 2 over the shared blocks: norms after each block, not before (DecoderLayer
norms="post": post_attention_layernorm and post_feedforward_layernorm on the blocks' outputs,
the blocks reading the residual stream itself), and an RMSNorm of the whole query and the whole
key projection before rotary (qk_norm="full", which does not split over tensor ranks)."""

from __future__ import annotations

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.llama import LAYER_TENSOR_MAP

OLMO2_LAYER_TENSOR_MAP: LayerTensorMap = {
    **{k: v for k, v in LAYER_TENSOR_MAP.items() if not k.startswith("input_layernorm")},
    "self_attn.q_norm.weight": ("self_attn.q_norm", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm", None),
    "post_feedforward_layernorm.weight": ("post_feedforward_layernorm", None),
}


class Olmo2ForCausalLM(DecoderForCausalLM):
    layer_tensor_map = OLMO2_LAYER_TENSOR_MAP
    supports_smoothing = False  # see DecoderForCausalLM

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, qk_norm="full", norms="post")
