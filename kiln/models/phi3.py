"""Phi-3 / Phi-4 over the shared blocks: Llama's layer, its checkpoint holding q/k/v as one
`qkv_proj` and gate/up as one `gate_up_proj` (cut into the shared map's parts at load, so
tensor-parallel cuts and pre-quantized scales load as for Llama), longrope or partial rotary
(Phi-4-mini) from the config. A sliding window shorter than the context is the window
machinery's (kiln.models.config)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.models.decoder import DecoderForCausalLM
from kiln.models.gguf_names import LLAMA_LAYER_NAMES, GGUFLayout
from kiln.models.llama import LAYER_TENSOR_MAP

# llama.cpp's converter keeps the fused tensors: attn_qkv, and ffn_up holding gate and up.
PHI3_GGUF = GGUFLayout(
    "phi3",
    {**LLAMA_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    permuted_rotary=False,
)


class Phi3ForCausalLM(DecoderForCausalLM):
    layer_tensor_map = LAYER_TENSOR_MAP
    supports_smoothing = False  # see DecoderForCausalLM

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """qkv_proj's rows as q_proj, k_proj and v_proj; gate_up_proj's as gate_proj and up_proj
        (weights, and per-row weight scales of a pre-quantized checkpoint)."""
        cfg = self.full_config
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return super().adapt_hf_weights(_unfused(weights, q, kv))


def _unfused(
    weights: Iterable[tuple[str, torch.Tensor]], q: int, kv: int
) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        stem, _, kind = name.rpartition(".")  # kind: weight, bias, weight_scale
        rows_fused = tensor.dim() > 0 and tensor.numel() > 1
        if stem.endswith("self_attn.qkv_proj") and rows_fused:
            parts = tensor.split([q, kv, kv], dim=0)
            base = stem.removesuffix("qkv_proj")
            yield from ((f"{base}{p}_proj.{kind}", t) for p, t in zip("qkv", parts))
        elif stem.endswith("mlp.gate_up_proj") and rows_fused:
            gate, up = tensor.chunk(2, dim=0)
            base = stem.removesuffix("gate_up_proj")
            yield from ((f"{base}gate_proj.{kind}", gate), (f"{base}up_proj.{kind}", up))
        elif stem.endswith(("self_attn.qkv_proj", "mlp.gate_up_proj")):  # one per-tensor scale
            base, fused = stem.rsplit(".", 1)
            parts = ("q", "k", "v") if fused == "qkv_proj" else ("gate", "up")
            yield from ((f"{base}.{p}_proj.{kind}", tensor) for p in parts)
        else:
            yield name, tensor
