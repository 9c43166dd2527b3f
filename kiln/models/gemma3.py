"""Gemma 3 (text, Gemma3ForCausalLM) over the shared blocks: Gemma 2's layer (sandwich norms,
local and global layers: five local to one global by default) with a (1 + w) RMSNorm of each
query and key head before rotary, and the local layers' own rotary base
(ModelConfig.rope_local_base_freq: their table, "local"), the global layers' with the config's
rope scaling."""

from __future__ import annotations

from typing import ClassVar

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import LayerTensorMap
from kiln.models.gemma import (
    SANDWICH_GGUF_NAMES,
    SANDWICH_LAYER_TENSOR_MAP,
    GemmaForCausalLM,
    gguf_query_scalar,
)
from kiln.models.gguf_names import GGUFLayout

GEMMA3_LAYER_TENSOR_MAP: LayerTensorMap = {
    **SANDWICH_LAYER_TENSOR_MAP,
    "self_attn.q_norm.weight": ("self_attn.q_norm", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm", None),
}

# llama.cpp's: five local layers to one global, the local ones on a base of 10000 (unless the
# file says rope.freq_base_swa), the file's rope scaling the global layers'.
GEMMA3_GGUF = GGUFLayout(
    "gemma3_text",
    {**SANDWICH_GGUF_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"},
    permuted_rotary=False,
    norm_offset=1.0,
    hf_config={"hidden_act": "gelu_pytorch_tanh", "rope_local_base_freq": 10000.0},
    implied_by_shape=gguf_query_scalar,
)


class Gemma3ForCausalLM(GemmaForCausalLM):
    layer_tensor_map: ClassVar[LayerTensorMap] = GEMMA3_LAYER_TENSOR_MAP
    norms: ClassVar[str] = "sandwich"
    qk_norm: ClassVar[bool] = True

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        # The decoder names layer i "layers.i" (i counted over the whole model).
        local = full.layer_window(int(prefix.rsplit(".", 1)[1])) is not None
        table = "local" if local and full.rope_local_base_freq is not None else None
        return DecoderLayer(
            cfg, prefix, method, dtype, ctx, full, self.qk_norm, self.norms, rope_table=table
        )
