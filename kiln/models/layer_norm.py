"""The decoder of the LayerNorm families (StableLM, Cohere): the shared decoder with LayerNorm
layers (DecoderLayer layer_norm=True, parallel where the config says) and a final LayerNorm,
with biases where the family has them (`has_norm_bias`)."""

from __future__ import annotations

from types import ModuleType
from typing import ClassVar

import torch
from torch import nn

from kiln.distributed.parallel_state import ParallelContext
from kiln.errors import ModelLoadError
from kiln.kernels import reference
from kiln.layers.linear import LinearMethod
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM


class LayerNormDecoderForCausalLM(DecoderForCausalLM):
    has_norm_bias: ClassVar[bool] = False  # the norms have biases (StableLM's nn.LayerNorm)
    supports_smoothing = False  # see DecoderForCausalLM
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
        if cfg.qk_layernorm:
            raise ModelLoadError(
                f"{cfg.architecture} with a per-head q/k LayerNorm is not supported"
            )
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
            parallel=cfg.parallel_residual,
        )  # fmt: skip

    def final_norm(
        self,
        ops: ModuleType,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        hidden_norm: torch.Tensor | None = None,  # None: LayerNorm layers have no output norm
    ) -> torch.Tensor:
        assert hidden_norm is None, "LayerNorm layers name no output norm"
        summed = hidden + residual
        return reference.layer_norm(summed, self.norm, self.norm_bias, self.config.rms_norm_eps)
