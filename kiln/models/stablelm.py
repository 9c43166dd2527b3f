"""StableLM 2 over the shared blocks: LayerNorms with biases, partial rotary (a quarter of each
head), q/k/v biases (use_qkv_bias), a SiLU gated MLP; attention and MLP in parallel where
use_parallel_residual is set. The 12B's per-head q/k LayerNorms (qk_layernorm: a LayerNorm
module per head in the checkpoint) are stacked into the shared [heads, head_dim] q/k norms."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from kiln.models.decoder import LayerTensorMap
from kiln.models.layer_norm import QK_NORM_LAYER_TENSOR_MAP, LayerNormDecoderForCausalLM

STABLELM_LAYER_TENSOR_MAP: LayerTensorMap = {
    **QK_NORM_LAYER_TENSOR_MAP,
    "input_layernorm.bias": ("input_layernorm_bias", None),
    "post_attention_layernorm.bias": ("post_attention_layernorm_bias", None),
}
# "model.layers.3.self_attn.q_layernorm.norms.5.weight": the layer's prefix, q or k, the head.
_HEAD_NORM = re.compile(r"(.*\.self_attn\.)([qk])_layernorm\.norms\.(\d+)\.weight")


class StableLmForCausalLM(LayerNormDecoderForCausalLM):
    layer_tensor_map = STABLELM_LAYER_TENSOR_MAP
    has_norm_bias = True

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.full_config
        counts = {"q": cfg.num_attention_heads, "k": cfg.num_key_value_heads}
        return super().adapt_hf_weights(_stacked_head_norms(weights, counts))


def _stacked_head_norms(
    weights: Iterable[tuple[str, torch.Tensor]], counts: dict[str, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each layer's per-head q (k) LayerNorm weights as one [heads, head_dim] `q_norm` (`k_norm`),
    yielded once its last head has come (a checkpoint's order is its own)."""
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in weights:
        match = _HEAD_NORM.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        stacked = f"{match[1]}{match[2]}_norm.weight"
        heads = pending.setdefault(stacked, {})
        heads[int(match[3])] = tensor
        if len(heads) == counts[match[2]]:
            yield stacked, torch.stack([heads[h] for h in range(len(heads))])
            del pending[stacked]
    if pending:  # the loader's missing-tensor check names what never completed
        yield from ((n, torch.stack(list(h.values()))) for n, h in pending.items())
