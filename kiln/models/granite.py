"""Granite 3 over the shared blocks: Llama's layer (attention and MLP biases where the config
sets them) with its four multipliers, all of them ModelConfig fields the shared decoder
applies: the embedding's (at the embedding), the residual's (folded into o_proj and down_proj
at load), the attention's (the query scale) and the logits' (1 / logits_scaling, folded into
the final norm at load)."""

from __future__ import annotations

from kiln.models.decoder import DecoderForCausalLM
from kiln.models.llama import LAYER_TENSOR_MAP


class GraniteForCausalLM(DecoderForCausalLM):
    layer_tensor_map = LAYER_TENSOR_MAP
