"""Qwen2-MoE: Qwen2's attention block (q/k/v biases, no q/k norm) with Qwen3-MoE's sparse
layers plus a shared expert every token runs, scaled by sigmoid(shared_expert_gate(x))."""

from __future__ import annotations

from kiln.models.decoder import LayerTensorMap
from kiln.models.llama import LAYER_TENSOR_MAP
from kiln.models.moe_blocks import EXPERT_TENSOR_MAP
from kiln.models.qwen3_moe import Qwen3MoeForCausalLM

QWEN2_MOE_LAYER_TENSOR_MAP: LayerTensorMap = {
    **LAYER_TENSOR_MAP,
    **EXPERT_TENSOR_MAP,
    **{
        f"mlp.shared_expert.{k.removeprefix('mlp.')}": (f"mlp.shared_expert.{name[4:]}", shard)
        for k, (name, shard) in LAYER_TENSOR_MAP.items()
        if k.startswith("mlp.")
    },
    "mlp.shared_expert_gate.weight": ("mlp.shared_expert_gate.weight", None),
}


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    layer_tensor_map = QWEN2_MOE_LAYER_TENSOR_MAP
    qk_norm = False
