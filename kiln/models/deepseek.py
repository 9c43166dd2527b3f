"""DeepSeek-V3 (DeepseekV3ForCausalLM) and DeepSeek-V2 (DeepseekV2ForCausalLM): multi-head
latent attention (kiln.models.mla) over GLM-4.5's mixture of experts: the first
first_k_dense_replace layers' MLPs dense, the others routed experts (V3: sigmoid scores with
e_score_correction_bias over groups, routed_scaling_factor; V2: a softmax over every expert)
plus shared experts added ungated. Rotary dims come paired (2i, 2i+1) in the checkpoint
(rope_interleave): their rows of q_b_proj / q_proj and kv_a_proj_with_mqa are de-interleaved
at load, so the rotate-half kernels compute the same q . k. Multi-token-prediction layers
(past num_hidden_layers) are dropped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.errors import ModelLoadError
from kiln.models.decoder import LayerTensorMap
from kiln.models.glm4_moe import GLM4_MOE_LAYER_TENSOR_MAP, Glm4MoeForCausalLM
from kiln.models.mla import LatentAttention

MLA_TENSOR_MAP: LayerTensorMap = {
    "self_attn.q_a_proj.weight": ("self_attn.qkv_a_proj.weight", 0),
    "self_attn.q_a_proj.bias": ("self_attn.qkv_a_proj.bias", 0),
    "self_attn.q_proj.weight": ("self_attn.qkv_a_proj.weight", 0),  # q_lora_rank None
    "self_attn.kv_a_proj_with_mqa.weight": ("self_attn.qkv_a_proj.weight", 1),
    "self_attn.kv_a_proj_with_mqa.bias": ("self_attn.qkv_a_proj.bias", 1),
    "self_attn.q_a_layernorm.weight": ("self_attn.q_a_layernorm", None),
    "self_attn.q_b_proj.weight": ("self_attn.q_b_proj.weight", None),
    "self_attn.kv_a_layernorm.weight": ("self_attn.kv_a_layernorm", None),
    "self_attn.kv_b_proj.weight": ("self_attn.kv_b_proj.weight", None),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "self_attn.o_proj.bias": ("self_attn.o_proj.bias", None),
}
DEEPSEEK_LAYER_TENSOR_MAP: LayerTensorMap = {
    **{k: v for k, v in GLM4_MOE_LAYER_TENSOR_MAP.items() if not k.startswith("self_attn.")},
    **MLA_TENSOR_MAP,
}


def deinterleave_rows(tensor: torch.Tensor, rope: int, period: int) -> torch.Tensor:
    """`tensor` with the last `rope` rows of each `period` rows reordered from pairs (2i, 2i+1)
    to the evens, then the odds: a rotate-half rotary of the result is the interleaved one's."""
    if tensor.dtype == torch.float8_e4m3fn:  # moved as bytes (no float8 CPU kernels)
        return deinterleave_rows(tensor.view(torch.uint8), rope, period).view(tensor.dtype)
    order = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    rows = tensor.view(-1, period, *tensor.shape[1:])
    head, tail = rows[:, : period - rope], rows[:, period - rope :]
    return torch.cat([head, tail[:, order]], dim=1).reshape(tensor.shape)


class DeepseekV3ForCausalLM(Glm4MoeForCausalLM):
    layer_tensor_map = DEEPSEEK_LAYER_TENSOR_MAP
    attention_class = LatentAttention

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return super().adapt_hf_weights(self._mla_tensors(weights))

    def _mla_tensors(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The rotary rows de-interleaved (rope_interleave), and a pre-quantized kv_b_proj
        widened to its dequantized values: the attention multiplies its halves in as they are
        (kiln.models.mla)."""
        cfg = self.full_config
        rope, qk = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        rows = {  # a projection -> (its rows per head, the rotary ones last; its rows)
            "q_proj": (qk, cfg.num_attention_heads * qk),
            "q_b_proj": (qk, cfg.num_attention_heads * qk),
            "kv_a_proj_with_mqa": (cfg.kv_lora_rank + rope, cfg.kv_lora_rank + rope),
        }
        held: dict[str, dict[str, torch.Tensor]] = {}  # a float8 kv_b_proj's parts, by layer
        for name, tensor in weights:
            prefix, _, kind = name.rpartition(".")
            module = prefix.rpartition(".")[2]
            quantized = kind != "weight" or tensor.dtype == _FLOAT8
            if module == "kv_b_proj" and kind in _DEQUANTIZED and quantized:
                parts = held.setdefault(prefix, {})
                parts[kind] = tensor
                if "weight" in parts and len(parts) == 2:
                    yield f"{prefix}.weight", _dequantized(held.pop(prefix), name)
                continue
            if cfg.rope_interleave and module in rows and kind in _PER_ROW:
                period, count = rows[module]
                if tensor.dim() >= 1 and tensor.shape[0] == count:
                    tensor = deinterleave_rows(tensor, rope, period)
            yield name, tensor
        if held:
            raise ModelLoadError(f"{sorted(held)[0]}: a float8 kv_b_proj without its scales")


_FLOAT8 = torch.float8_e4m3fn
# Tensors with a value per output row: permuted with their projection's rows. Block scales
# ([rows / 128, ...]) stay: a head's rotary rows lie inside one 128-row block.
_PER_ROW = ("weight", "bias", "weight_scale")
_DEQUANTIZED = ("weight", "weight_scale", "weight_scales")  # a float8 weight and its scales


def _dequantized(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A float8 weight times its scales: per 128x128 block (`weight_scales`), per row or per
    tensor (`weight_scale`), in fp32."""
    weight = parts.pop("weight").float()
    ((kind, scale),) = parts.items()
    scale = scale.float()
    rows, k = weight.shape
    if kind == "weight_scales" and tuple(scale.shape) == (-(-rows // 128), -(-k // 128)):
        wide = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
        return weight * wide[:rows, :k]
    if kind == "weight_scale" and scale.numel() in (1, rows):
        return weight * scale.reshape(-1, 1)
    raise ModelLoadError(f"{name}: scales {tuple(scale.shape)} for a {rows}x{k} kv_b_proj")


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    """V2's layers are V3's; its router a softmax (cfg.moe_routing), no routing bias."""
