"""Qwen3 (dense): the Llama block shape with a per-head RMSNorm of queries and keys before
rotary (`q_norm` / `k_norm`, over head_dim), no q/k/v biases, head_dim from the config (not
hidden / heads), tied or untied embeddings."""

from __future__ import annotations

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.gguf_names import LLAMA_LAYER_NAMES, GGUFLayout
from kiln.models.llama import LAYER_TENSOR_MAP

QWEN3_LAYER_TENSOR_MAP: LayerTensorMap = {
    **LAYER_TENSOR_MAP,
    "self_attn.q_norm.weight": ("self_attn.q_norm", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm", None),
}

# llama.cpp's converter writes Qwen3's q/k rows in Hugging Face's order (no rotary permute).
QWEN3_GGUF = GGUFLayout(
    "qwen3",
    {**LLAMA_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    permuted_rotary=False,
)


class Qwen3ForCausalLM(DecoderForCausalLM):
    layer_tensor_map = QWEN3_LAYER_TENSOR_MAP

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, qk_norm=True)
