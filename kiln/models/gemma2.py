"""Gemma 2 over the shared blocks: Gemma's layer (kiln.models.gemma: (1 + w) norms, scaled
embedding, GeGLU) with sandwich norms, local (sliding-window) and global layers alternating
(ModelConfig.layer_types, read by the attention backend per layer), attention logits soft-capped
in the attention kernels, the final logits soft-capped, and query_pre_attn_scalar's scale."""

from __future__ import annotations

from typing import ClassVar

from kiln.models.decoder import LayerTensorMap
from kiln.models.gemma import (
    SANDWICH_GGUF_NAMES,
    SANDWICH_LAYER_TENSOR_MAP,
    GemmaForCausalLM,
    gguf_query_scalar,
)
from kiln.models.gguf_names import GGUFLayout

# Its soft-caps and window are the file's metadata; its layers alternate as llama.cpp's do.
GEMMA2_GGUF = GGUFLayout(
    "gemma2", SANDWICH_GGUF_NAMES, permuted_rotary=False, norm_offset=1.0,
    hf_config={"hidden_act": "gelu_pytorch_tanh"}, implied_by_shape=gguf_query_scalar,
)  # fmt: skip


class Gemma2ForCausalLM(GemmaForCausalLM):
    layer_tensor_map: ClassVar[LayerTensorMap] = SANDWICH_LAYER_TENSOR_MAP
    norms: ClassVar[str] = "sandwich"
