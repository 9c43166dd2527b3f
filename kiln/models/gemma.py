"""Gemma over the shared blocks: Llama's layer with (1 + w) RMSNorms (the +1 folded into each
norm's weight at load, so the fused norm kernels serve; exact in fp32, one extra rounding of
the weight in bf16), the embedding scaled by sqrt(hidden) rounded to the model dtype (as
transformers rounds it), a GeGLU MLP (gelu_pytorch_tanh), head_dim from the config, tied
embeddings. Gemma 2/3 subclass it with `norms = "sandwich"` (their pre/post feed-forward norms,
SANDWICH_LAYER_TENSOR_MAP) and their attention kinds."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, ClassVar

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.layers.linear import LinearMethod
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.gguf_names import LLAMA_LAYER_NAMES, GGUFLayout
from kiln.models.llama import LAYER_TENSOR_MAP

SANDWICH_LAYER_TENSOR_MAP: LayerTensorMap = {
    **LAYER_TENSOR_MAP,
    "pre_feedforward_layernorm.weight": ("pre_feedforward_layernorm", None),
    "post_feedforward_layernorm.weight": ("post_feedforward_layernorm", None),
}
# Gemma 3's: the sandwich norms and per-head (1 + w) q/k norms (qk_norm = True).
QK_NORM_SANDWICH_LAYER_TENSOR_MAP: LayerTensorMap = {
    **SANDWICH_LAYER_TENSOR_MAP,
    "self_attn.q_norm.weight": ("self_attn.q_norm", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm", None),
}

# llama.cpp's converter writes Gemma's q/k rows in Hugging Face's order and its norms with the
# +1 already added (norm_offset: subtracted back, then added again as for a checkpoint).
GEMMA_GGUF = GGUFLayout(
    "gemma", LLAMA_LAYER_NAMES, permuted_rotary=False, norm_offset=1.0,
    hf_config={"hidden_act": "gelu_pytorch_tanh"},
)  # fmt: skip
# Gemma 2/3's sandwich norms as llama.cpp names them (its ffn_norm is the pre-MLP norm).
SANDWICH_GGUF_NAMES = {
    **LLAMA_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# The 27B models' layer counts (Gemma 2's, Gemma 3's), whose query scale llama.cpp takes from
# hidden / heads rather than head_dim (their query_pre_attn_scalar).
_SCALED_BY_HIDDEN_LAYERS = (46, 62)


def gguf_query_scalar(shape: Mapping[str, Any]) -> dict[str, Any]:
    """Gemma 2/3's query_pre_attn_scalar, which their GGUF files do not store: llama.cpp's
    rule (head_dim, or hidden / heads for the 27B models)."""
    if shape["num_hidden_layers"] in _SCALED_BY_HIDDEN_LAYERS:
        return {"query_pre_attn_scalar": shape["hidden_size"] // shape["num_attention_heads"]}
    return {"query_pre_attn_scalar": shape["head_dim"]}


class GemmaForCausalLM(DecoderForCausalLM):
    layer_tensor_map: ClassVar[LayerTensorMap] = LAYER_TENSOR_MAP
    supports_smoothing = False  # see DecoderForCausalLM
    norms: ClassVar[str] = "pre"  # DecoderLayer's norm placement ("sandwich": Gemma 2/3)
    qk_norm: ClassVar[bool] = False  # Gemma 3's per-head q/k norms, (1 + w) too

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        linear_method: LinearMethodFactory | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
        lm_head_method: LinearMethod | None = None,
    ) -> None:
        super().__init__(cfg, max_positions, linear_method, dtype, parallel, lm_head_method)
        rounded = torch.tensor(cfg.embedding_multiplier, dtype=dtype or torch.float32)
        self.embedding_multiplier = float(rounded.item())

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, self.qk_norm, self.norms)

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Every RMSNorm weight w as the 1 + w it scales by (in fp32, then the model dtype)."""
        shifted = (
            (name, tensor.float() + 1.0 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )
        return super().adapt_hf_weights(shifted)
