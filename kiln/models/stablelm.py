"""StableLM 2 over the shared blocks: LayerNorms with biases, partial rotary (a quarter of each
head), q/k/v biases (use_qkv_bias), a SiLU gated MLP; attention and MLP in parallel where
use_parallel_residual is set. The per-head q/k LayerNorm of the 12B (qk_layernorm) is refused."""

from __future__ import annotations

from kiln.models.decoder import LayerTensorMap
from kiln.models.layer_norm import LayerNormDecoderForCausalLM
from kiln.models.llama import LAYER_TENSOR_MAP

STABLELM_LAYER_TENSOR_MAP: LayerTensorMap = {
    **LAYER_TENSOR_MAP,
    "input_layernorm.bias": ("input_layernorm_bias", None),
    "post_attention_layernorm.bias": ("post_attention_layernorm_bias", None),
}


class StableLmForCausalLM(LayerNormDecoderForCausalLM):
    layer_tensor_map = STABLELM_LAYER_TENSOR_MAP
    has_norm_bias = True
