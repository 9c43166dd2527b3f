"""GLM-4.5 (Glm4MoeForCausalLM): Llama's attention with q/k/v biases, rotary on the first half
of each head and optional per-head q/k RMSNorm; the first first_k_dense_replace layers' MLPs
dense, the others DeepSeek-V3's mixture (sigmoid routing with e_score_correction_bias over
groups of experts, kiln.kernels.reference.sigmoid_group_route) plus a shared expert added
ungated. The per-expert gate/up/down tensors are stacked at load time; the checkpoint's
multi-token-prediction layers (past num_hidden_layers) are dropped."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from typing import cast

import torch
from torch import nn

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory, RopeAttention
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.moe_blocks import EXPERT_TENSOR_MAP, SparseMoeBlock, adapt_expert_weights
from kiln.models.qwen2_moe import QWEN2_MOE_LAYER_TENSOR_MAP
from kiln.models.qwen3 import QWEN3_LAYER_TENSOR_MAP
from kiln.models.qwen3_moe import QWEN_EXPERT_PARTS

GLM4_MOE_LAYER_TENSOR_MAP: LayerTensorMap = {
    **QWEN3_LAYER_TENSOR_MAP,
    **EXPERT_TENSOR_MAP,
    **{  # Qwen2-MoE's shared expert's, under GLM's plural name
        name.replace("shared_expert.", "shared_experts.", 1): target
        for name, target in QWEN2_MOE_LAYER_TENSOR_MAP.items()
        if name.startswith("mlp.shared_expert.")
    },
    "mlp.gate.e_score_correction_bias": ("mlp.experts.e_score_correction_bias", None),
}

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class Glm4MoeForCausalLM(DecoderForCausalLM):
    layer_tensor_map = GLM4_MOE_LAYER_TENSOR_MAP
    supports_smoothing = False  # the sparse layers have no gate/up projection to fold into
    # The layers' attention, built as (cfg, prefix, method, dtype, ctx, full); None:
    # DecoderLayer's RopeAttention. DeepSeek's is multi-head latent attention.
    attention_class: Callable[..., nn.Module] | None = None

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        index = int(prefix.rsplit(".", 1)[1])  # the whole model's layer index
        mlp = None
        if full.is_sparse_layer(index):
            mlp = SparseMoeBlock(cfg, f"{prefix}.mlp", method, dtype, ctx)
        attention = None
        if self.attention_class is not None:
            # Typed as RopeAttention for the layer: its call (project_qkv, attend, kind) is one.
            attention = cast(
                RopeAttention,
                self.attention_class(cfg, f"{prefix}.self_attn", method, dtype, ctx, full),
            )
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, qk_norm=cfg.qk_layernorm,
                            mlp=mlp, attention=attention)  # fmt: skip

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        layers = self.full_config.num_hidden_layers  # the MTP layers are numbered after them
        kept = (
            (name, tensor)
            for name, tensor in weights
            if not ((m := _LAYER_RE.match(name)) and int(m.group(1)) >= layers)
        )
        experts = adapt_expert_weights(self, kept, self.config.num_experts, QWEN_EXPERT_PARTS)
        return super().adapt_hf_weights(experts)
