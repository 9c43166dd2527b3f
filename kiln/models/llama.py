"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2/2.5, SmolLM2, TinyLlama) over the shared
blocks: RMSNorm, rotary attention with GQA (q/k/v, o and MLP biases where the checkpoint has
them: attention_bias, mlp_bias), a SiLU gated MLP. q/k/v and gate/up are fused into one
projection each at load time."""

from __future__ import annotations

from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.gguf_names import LLAMA_LAYER_NAMES, GGUFLayout

# One decoder layer's HF tensors -> (kiln parameter, index of the fused shard in the layer's
# output_sizes, None when not fused). The EAGLE-3 head's midlayer loads by it too.
LAYER_TENSOR_MAP: LayerTensorMap = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "self_attn.o_proj.bias": ("self_attn.o_proj.bias", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "mlp.gate_proj.bias": ("mlp.gate_up_proj.bias", 0),
    "mlp.up_proj.bias": ("mlp.gate_up_proj.bias", 1),
    "mlp.down_proj.bias": ("mlp.down_proj.bias", None),
    "input_layernorm.weight": ("input_layernorm", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm", None),
}

# llama.cpp's converter permutes Llama's q/k rows; its Qwen2 keeps Hugging Face's order.
LLAMA_GGUF = GGUFLayout("llama", LLAMA_LAYER_NAMES, permuted_rotary=True)
QWEN2_GGUF = GGUFLayout("qwen2", LLAMA_LAYER_NAMES, permuted_rotary=False)


class LlamaForCausalLM(DecoderForCausalLM):
    """Llama, Mistral (no window shorter than the context) and Qwen2: the shared decoder with
    its default layers (kiln.models.blocks.DecoderLayer)."""

    layer_tensor_map = LAYER_TENSOR_MAP
