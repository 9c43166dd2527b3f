"""The decoder of the LayerNorm families (StableLM, Cohere, Starcoder2): the shared decoder with
LayerNorm layers (DecoderLayer layer_norm=True, parallel where the config says; the norm
kernels' LayerNorm flavour) and a final LayerNorm (the same kernel, with the last residual add),
with biases where the family has them (`has_norm_bias`), and a LayerNorm of each query and key
head before rotary where the config says (qk_layernorm: RopeAttention qk_norm="head_layer",
its [heads, head_dim] weights cut to a tensor rank's heads at load)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from kiln.distributed.parallel_state import ParallelContext, kv_head_range
from kiln.layers.linear import LinearMethod
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.llama import LAYER_TENSOR_MAP

# Llama's names and the per-head q/k norms' (Cohere's names; StableLM's are renamed to them).
QK_NORM_LAYER_TENSOR_MAP: LayerTensorMap = {
    **LAYER_TENSOR_MAP,
    "self_attn.q_norm.weight": ("self_attn.q_norm", None),
    "self_attn.k_norm.weight": ("self_attn.k_norm", None),
}


class LayerNormDecoderForCausalLM(DecoderForCausalLM):
    has_norm_bias: ClassVar[bool] = False  # the norms have biases (StableLM's nn.LayerNorm)
    norm_bias: nn.Parameter | None

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
        self.norm_bias = None
        if self.has_norm_bias:
            self.norm_bias = nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype))

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
            cfg, prefix, method, dtype, ctx, full, layer_norm=True, norm_bias=self.has_norm_bias,
            parallel=cfg.parallel_residual, qk_norm="head_layer" if cfg.qk_layernorm else False,
        )  # fmt: skip

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The per-head q/k norms' rows of this tensor rank's heads."""
        ctx, cfg = self.parallel, self.full_config
        if ctx is None or ctx.tp_size == 1:
            return super().adapt_hf_weights(weights)
        per_rank = cfg.num_attention_heads // ctx.tp_size
        heads = {
            "q_norm": (ctx.tp_rank * per_rank, per_rank),
            "k_norm": kv_head_range(cfg.num_key_value_heads, ctx.tp_size, ctx.tp_rank),
        }

        def cut(name: str, tensor: torch.Tensor) -> torch.Tensor:
            norm = name.removesuffix(".weight").rsplit(".", 1)[-1]
            if ".self_attn." not in name or norm not in heads or tensor.dim() != 2:
                return tensor
            return tensor.narrow(0, *heads[norm])

        return super().adapt_hf_weights((n, cut(n, t)) for n, t in weights)

    def final_norm(
        self,
        ops: ModuleType,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        hidden_norm: torch.Tensor | None = None,  # None: LayerNorm layers have no output norm
    ) -> torch.Tensor:
        assert hidden_norm is None, "LayerNorm layers name no output norm"
        eps, bias = self.config.rms_norm_eps, self.norm_bias
        return ops.fused_add_rms_norm(hidden, residual, self.norm, eps, None, bias, True)[0]
