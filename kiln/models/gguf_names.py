"""How llama.cpp's converter names a family's tensors in a GGUF file, as a table each model
family provides (GGUFLayout): the GGUF reader (kiln.checkpoint.gguf_loader) turns them into
Hugging Face names, which the family's own name map then loads like a safetensors checkpoint."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

# The tensors outside the decoder layers, alike in every family.
GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",  # a LayerNorm family's (Starcoder2)
    "output.weight": "lm_head.weight",
}
# A Llama-shaped decoder layer: GGUF tensor stem -> HF module within the layer.
LLAMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GGUFLayout:
    """One GGUF architecture's tensor names and layout."""

    architecture: str
    """The kiln architecture (registry) its tensors load into."""
    layer_names: Mapping[str, str]
    """GGUF layer tensor stem ("attn_q") -> HF module within the layer ("self_attn.q_proj")."""
    permuted_rotary: bool
    """llama.cpp's converter interleaved each q/k head's rotary halves (its LlamaModel does;
    Qwen2 and Qwen3 keep Hugging Face's order)."""
    norm_offset: float = 0.0
    """What llama.cpp's converter added to every norm weight (Gemma's (1 + w) norms: 1)."""
    hf_config: Mapping[str, Any] = field(default_factory=dict)
    """config.json fields the family's GGUF files imply and do not store (Gemma's activation)."""
    implied_by_shape: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    """config.json fields llama.cpp derives from the model's shape (its config.json fields:
    num_hidden_layers, hidden_size, num_attention_heads, head_dim) and does not store."""

    def hf_name(self, gguf_name: str) -> str | None:
        """The HF name of a GGUF tensor, or None if this layout has no such tensor."""
        if gguf_name in GLOBAL_NAMES:
            return GLOBAL_NAMES[gguf_name]
        match = _LAYER_TENSOR.fullmatch(gguf_name)
        if match and match[2] in self.layer_names:
            return f"model.layers.{match[1]}.{self.layer_names[match[2]]}.{match[3]}"
        return None

    def to_hf_layout(
        self, hf_name: str, tensor: torch.Tensor, num_heads: int, num_kv_heads: int
    ) -> torch.Tensor:
        """A tensor as the HF checkpoint holds it (q/k rows back in rotate-half order, norms
        without the converter's offset)."""
        if self.norm_offset and hf_name.endswith("norm.weight"):
            return tensor - self.norm_offset
        if not self.permuted_rotary:
            return tensor
        if ".q_proj." in hf_name:
            return unpermute_rotary(tensor, num_heads)
        if ".k_proj." in hf_name:
            return unpermute_rotary(tensor, num_kv_heads)
        return tensor


def unpermute_rotary(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's convert permutation of q/k rows (weights and biases).

    convert_hf_to_gguf interleaves each head's two rotary halves:
    `w.reshape(n_head, 2, dim // n_head // 2, *rest).swapaxes(1, 2).reshape(shape)`; this is the
    inverse, giving HF's rotate_half layout back.
    """
    shape = w.shape
    halves = w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:])
    return halves.transpose(1, 2).reshape(shape)
