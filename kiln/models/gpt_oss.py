"""gpt-oss: attention with q/k/v/o biases and a learned sink logit per head, alternating
sliding-window (128) and full layers, yarn rope; every layer's MLP a mixture of experts whose
router has a bias (its top-k logits softmaxed: the top-k of the softmax renormalised) and
whose experts have biases and a clamped SwiGLU, run by kiln.models.moe_blocks.SparseMoeBlock.

Its checkpoint stacks the experts already, transposed ([E, in, out]) and with gate and up
interleaved column by column (gate_up_proj[..., ::2] is the gate); adapt_hf_weights turns them
into FusedMoE's [gate; up] rows. OpenAI's MXFP4 experts arrive as float8 with a scale per output
channel (kiln.checkpoint.fp4_formats.openai_mxfp4_tensors), in the same layout.

Under tensor parallelism (vLLM's layout) the heads and their sinks split as the other families'
heads (RopeAttention.cut_sinks), and the stacked experts, float8 ones quantized whole, are cut
to the rank's part (kiln.layers.moe_parallel.ExpertShard: a slice of every expert's gate and up
rows with their bias and scales and of its down columns, the down bias on the first rank; or
whole experts under expert parallelism)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.models.blocks import DecoderLayer, LinearMethodFactory
from kiln.models.config import ModelConfig
from kiln.models.decoder import DecoderForCausalLM, LayerTensorMap
from kiln.models.llama import LAYER_TENSOR_MAP
from kiln.models.moe_blocks import (
    EXPERT_TENSOR_MAP,
    SparseMoeBlock,
    cut_stacked_experts,
    expert_parameters,
    quantize_float8_experts,
)

GPT_OSS_LAYER_TENSOR_MAP: LayerTensorMap = {
    **{k: v for k, v in LAYER_TENSOR_MAP.items() if not k.startswith("mlp.")},
    **EXPERT_TENSOR_MAP,
    "self_attn.sinks": ("self_attn.sinks", None),
    "mlp.router.weight": ("mlp.gate.weight", None),
    "mlp.router.bias": ("mlp.gate.bias", None),
}
# The checkpoint's expert tensors (after "mlp.experts.") -> (FusedMoE's, whether its last dim
# holds interleaved gate/up columns, whether it is [E, in, out] and turns to [E, out, in]).
_EXPERT_TENSORS = {
    "gate_up_proj": ("w13_weight", True, True),
    "gate_up_proj_scale": ("w13_weight_scale", True, False),
    "gate_up_proj_bias": ("w13_bias", True, False),
    "down_proj": ("w2_weight", False, True),
    "down_proj_scale": ("w2_weight_scale", False, False),
    "down_proj_bias": ("w2_bias", False, False),
}


class GptOssForCausalLM(DecoderForCausalLM):
    layer_tensor_map = GPT_OSS_LAYER_TENSOR_MAP
    supports_smoothing = False  # no gate/up projection to fold a smoothing into

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        mlp = SparseMoeBlock(cfg, f"{prefix}.mlp", method, dtype, ctx)
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, mlp=mlp, sinks=True)

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        experts = quantize_float8_experts(_expert_tensors(weights), expert_parameters(self))
        return super().adapt_hf_weights(cut_stacked_experts(self, experts))


def _expert_tensors(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's expert tensors as FusedMoE's parameters: [out, in] per expert, gate
    rows then up rows; other tensors as they are."""
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".mlp.experts.")
        if not prefix or leaf not in _EXPERT_TENSORS:
            yield name, tensor
            continue
        param, interleaved, transposed = _EXPERT_TENSORS[leaf]
        if transposed:
            tensor = tensor.transpose(1, 2)
        if interleaved:  # rows (or the last dim) 0, 2, 4, ... are the gate's
            rows = torch.arange(tensor.shape[1], device=tensor.device)
            tensor = tensor.index_select(1, torch.cat([rows[0::2], rows[1::2]]))
        yield f"{prefix}.mlp.experts.{param}", tensor.contiguous()
