"""The mixture-of-experts MLP block the MoE families share (called as GatedMLP is): the norm,
the router, the routed experts (kiln.layers.moe.FusedMoE) and, for Qwen2-MoE, a shared expert
every token runs, gated by a sigmoid of its own projection; and the checkpoint adapter that
stacks the per-expert tensors Hugging Face saves into the experts' stacked parameters."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator, Mapping
from types import ModuleType

import torch
from torch import nn

from kiln.distributed.parallel_state import ParallelContext
from kiln.errors import ModelLoadError
from kiln.layers.linear import Linear, UnquantizedLinearMethod
from kiln.layers.moe import (
    Fp8MoEMethod,
    FusedMoE,
    MoEMethod,
    UnquantizedMoEMethod,
    quantize_experts_fp8,
)
from kiln.layers.quantization.fp8 import Fp8LinearMethod
from kiln.models.blocks import GatedMLP, LinearMethodFactory
from kiln.models.config import ModelConfig

# model.layers.L.<mlp or block_sparse_moe>.experts.E.<projection>.weight
_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$"
)


class SparseMoeBlock(nn.Module):
    """router (`gate`, kept in the model dtype whatever the projections' method: a few columns
    that pick the experts), `experts`, and with cfg.shared_expert_intermediate_size a
    `shared_expert` (a GatedMLP, by the projections' method) scaled by
    sigmoid(`shared_expert_gate`(x)). The experts are float8 under an FP8 quantization
    (kiln.layers.moe.Fp8MoEMethod), else in the model dtype."""

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if ctx is not None and ctx.tp_size > 1:
            raise ModelLoadError("mixture-of-experts layers run at tensor_parallel_size=1 only")
        h = cfg.hidden_size
        self.gate = Linear(h, cfg.num_experts, method=UnquantizedLinearMethod(), dtype=dtype)
        self.experts = FusedMoE(
            cfg.num_experts, cfg.num_experts_per_tok, h, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, dtype, _experts_method(method, f"{prefix}.experts"),
        )  # fmt: skip
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = GatedMLP(shared, f"{prefix}.shared_expert", method, dtype)
            self.shared_expert_gate = Linear(h, 1, method=UnquantizedLinearMethod(), dtype=dtype)

    def forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the block's output, x + residual)
        if norm_weight is None:
            normed = summed = x if residual is None else x + residual
        elif residual is None:
            normed, summed = ops.rms_norm(x, norm_weight, eps), x
        else:
            normed, summed = ops.fused_add_rms_norm(x, residual, norm_weight, eps)
        out = self.experts(ops, normed, self.gate(ops, normed))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared, _ = self.shared_expert(ops, normed, None, None, eps)
            out = out + torch.sigmoid(self.shared_expert_gate(ops, normed)) * shared
        return out, summed


def _experts_method(method: LinearMethodFactory, name: str) -> MoEMethod:
    """float8 experts where the method gives the experts an FP8 method: "fp8-dynamic", or "fp8"
    with dummy weights' stand-in static scales (the experts' kernels scale their activations
    per token, so they need no calibrated ones); else (a calibrated static engine names no
    experts) the model dtype."""
    try:
        linear = method(name)
    except ModelLoadError:
        return UnquantizedMoEMethod()
    if isinstance(linear, Fp8LinearMethod):
        return Fp8MoEMethod()
    return UnquantizedMoEMethod()


def stack_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    num_experts: int,
    parts: Mapping[str, tuple[str, int]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's per-expert projections stacked into the
    experts' parameters: `parts` maps a projection's HF name ("w1", "gate_proj") to (the
    FusedMoE parameter, its row block: 0 gate, 1 up, 0 for down alone), yielded as
    model.layers.L.mlp.experts.<parameter> once every expert's blocks have come. Other tensors
    pass through."""
    blocks_of = {param: 1 + max(b for p, b in parts.values() if p == param) for param, _ in
                 parts.values()}  # fmt: skip
    pending: dict[tuple[int, str], dict[tuple[int, int], torch.Tensor]] = {}
    for name, tensor in weights:
        match = _EXPERT_RE.match(name)
        if match is None or match.group(3) not in parts:
            yield name, tensor
            continue
        layer, expert = int(match.group(1)), int(match.group(2))
        if not 0 <= expert < num_experts:
            raise ModelLoadError(f"{name!r}: expert {expert} of a {num_experts}-expert model")
        param, block = parts[match.group(3)]
        got = pending.setdefault((layer, param), {})
        got[(expert, block)] = tensor
        if len(got) == num_experts * blocks_of[param]:
            del pending[(layer, param)]
            stacked = torch.stack([
                torch.cat([got[(e, b)] for b in range(blocks_of[param])])
                for e in range(num_experts)
            ])  # fmt: skip
            yield f"model.layers.{layer}.mlp.experts.{param}", stacked
    if pending:
        (layer, param), got = next(iter(pending.items()))
        raise ModelLoadError(
            f"checkpoint lacks experts' tensors: layer {layer} {param} has {len(got)} of "
            f"{num_experts * blocks_of[param]}"
        )


def adapt_expert_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    num_experts: int,
    parts: Mapping[str, tuple[str, int]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A MoE family's checkpoint as its model loads it: the experts stacked, and quantized
    where the model's experts are float8. `model`: a DecoderForCausalLM (its layer_start)."""
    start = getattr(model, "layer_start", 0)
    params = {}
    for name, param in model.named_parameters():
        if name.startswith("layers.") and ".experts." in name:
            index, rest = name.removeprefix("layers.").split(".", 1)
            params[f"model.layers.{start + int(index)}.{rest}"] = param
    return quantize_float8_experts(stack_expert_weights(weights, num_experts, parts), params)


def quantize_float8_experts(
    weights: Iterable[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked experts' tensors (stack_expert_weights's) in the model dtype whose parameter in
    `params` (the model's, by HF name) is float8: quantized, each followed by its scale."""
    for name, tensor in weights:
        param = params.get(name)
        if param is None or param.dtype != torch.float8_e4m3fn or tensor.element_size() == 1:
            yield name, tensor
            continue
        fp8, scale = quantize_experts_fp8(tensor)
        yield name, fp8
        yield f"{name}_scale", scale


# The experts' stacked parameters, loaded whole (as stack_expert_weights names them).
EXPERT_TENSOR_MAP = {
    "mlp.gate.weight": ("mlp.gate.weight", None),
    "mlp.experts.w13_weight": ("mlp.experts.w13_weight", None),
    "mlp.experts.w2_weight": ("mlp.experts.w2_weight", None),
    "mlp.experts.w13_weight_scale": ("mlp.experts.w13_weight_scale", None),
    "mlp.experts.w2_weight_scale": ("mlp.experts.w2_weight_scale", None),
}
