"""Starcoder2 over the shared blocks: LayerNorms with biases (kiln.models.layer_norm), q/k/v/o
biases (use_bias), an ungated GELU-tanh MLP (c_fc, c_proj: blocks.PlainMLP), tied embeddings,
and a sliding window on every layer when the config gives one (the KV manager then frees the
blocks behind it)."""

from __future__ import annotations

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import LayerTensorMap
from kiln.models.gguf_names import LLAMA_LAYER_NAMES, GGUFLayout
from kiln.models.layer_norm import LayerNormDecoderForCausalLM
from kiln.models.llama import LAYER_TENSOR_MAP

STARCODER2_LAYER_TENSOR_MAP: LayerTensorMap = {
    **{k: v for k, v in LAYER_TENSOR_MAP.items() if not k.startswith("mlp.")},
    "mlp.c_fc.weight": ("mlp.c_fc.weight", None),
    "mlp.c_fc.bias": ("mlp.c_fc.bias", None),
    "mlp.c_proj.weight": ("mlp.c_proj.weight", None),
    "mlp.c_proj.bias": ("mlp.c_proj.bias", None),
    "input_layernorm.bias": ("input_layernorm_bias", None),
    "post_attention_layernorm.bias": ("post_attention_layernorm_bias", None),
}

# llama.cpp's converter: q/k rows in HF's order, c_fc / c_proj as ffn_up / ffn_down.
STARCODER2_GGUF = GGUFLayout(
    "starcoder2",
    {**LLAMA_LAYER_NAMES, "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
    permuted_rotary=False,
    hf_config={"hidden_act": "gelu_pytorch_tanh"},
)


class Starcoder2ForCausalLM(LayerNormDecoderForCausalLM):
    layer_tensor_map = STARCODER2_LAYER_TENSOR_MAP
    has_norm_bias = True
    supports_smoothing = False  # an ungated MLP (c_fc): no gate/up projection to fold into

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        return DecoderLayer(
            cfg, prefix, method, dtype, ctx, full, layer_norm=True, norm_bias=True,
            gated_mlp=False,
        )  # fmt: skip
