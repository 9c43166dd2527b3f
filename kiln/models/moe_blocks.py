"""The mixture-of-experts MLP block the MoE families share (called as GatedMLP is): the norm,
the router, the routed experts (kiln.layers.moe.FusedMoE) and, for Qwen2-MoE, a shared expert
every token runs, gated by a sigmoid of its own projection; and the checkpoint adapter that
stacks the per-expert tensors Hugging Face saves into the experts' stacked parameters."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType

import torch
from torch import nn

from kiln.distributed.comm import tp_all_reduce
from kiln.distributed.parallel_state import ParallelContext
from kiln.errors import ModelLoadError
from kiln.kernels.reference import FP8_BLOCK
from kiln.layers.linear import Linear, UnquantizedLinearMethod
from kiln.layers.moe import (
    Fp8MoEMethod,
    FusedMoE,
    MoEMethod,
    UnquantizedMoEMethod,
    quantize_experts_fp8,
)
from kiln.layers.moe_fp8_block import Fp8BlockMoEMethod, quantize_experts_fp8_block
from kiln.layers.moe_int4 import Int4MoEMethod
from kiln.layers.moe_parallel import Quantize, rank_shard
from kiln.layers.moe_w8a16 import GROUP, W8A16MoEMethod, quantize_experts_w8
from kiln.layers.quantization.fp8 import Fp8LinearMethod
from kiln.layers.quantization.fp8_block import Fp8BlockLinearMethod, rows_of
from kiln.layers.quantization.int4 import Int4LinearMethod
from kiln.layers.quantization.int8 import Int8LinearMethod
from kiln.layers.quantization.w8a16 import W8A16LinearMethod
from kiln.models.blocks import GatedMLP, LinearMethodFactory, norm_then_project
from kiln.models.config import ModelConfig

# model.layers.L.<mlp or block_sparse_moe>.experts.E.<projection>.<weight, or a pre-quantized
# checkpoint's scale: per channel, per tensor or per 128x128 block (weight_scale_inv: a
# Mixtral-named release's, which eight_bit_tensors leaves as it is)>
_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\."
    r"(weight|weight_scales?|weight_scale_inv|weight_zeros)$"
)
# An INT4 expert projection's input groups (kiln.checkpoint.int4_formats' weight_g_idx).
_EXPERT_G_IDX_RE = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.\d+\.\w+\.weight_g_idx$"
)
# A checkpoint tensor's suffix -> the suffix of the stacked parameter it loads into: float8
# experts' scales (any of their names) into <param>_scale; INT4 experts' (Int4MoEMethod).
_FLOAT8_SUFFIXES = {"weight": "", "weight_scale": "_scale", "weight_scales": "_scale",
                    "weight_scale_inv": "_scale"}  # fmt: skip
INT4_SUFFIXES = {"weight": "", "weight_scales": "_scales", "weight_zeros": "_zeros"}


_STACKED_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(w13_\w+|w2_\w+)$")


class SparseMoeBlock(nn.Module):
    """router (`gate`, kept in the model dtype whatever the projections' method: a few columns
    that pick the experts; fp32 for sigmoid routing, as transformers has it), `experts`, and
    with cfg.shared_expert_intermediate_size a `shared_expert` (a GatedMLP, by the projections'
    method) scaled by sigmoid(`shared_expert_gate`(x)), or added as it is
    (cfg.shared_expert_gated False: GLM). The experts are float8 under an FP8 quantization
    (kiln.layers.moe.Fp8MoEMethod; fp8-block: kiln.layers.moe_fp8_block), INT4 under an INT4
    checkpoint's (kiln.layers.moe_int4), 8-bit weight-only under a W8A16 or W8A8 INT8 one
    (kiln.layers.moe_w8a16), else in the model dtype."""

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        h = cfg.hidden_size
        # Under TP (cfg is this rank's shard): this rank's part of the experts, and of the
        # shared expert; their partial outputs are summed in one all-reduce (`reduce`).
        shard = rank_shard(ctx, cfg.num_experts, cfg.expert_range, cfg.moe_intermediate_size)
        per_channel = cfg.per_channel_experts
        self.reduce = None if shard is None else shard.ctx
        # transformers' sigmoid routers project in fp32: in bf16 a near tie of biased scores
        # would pick another expert.
        router_dtype = torch.float32 if cfg.moe_routing == "sigmoid" else dtype
        self.gate = Linear(
            h, cfg.num_experts, bias=cfg.moe_bias, method=UnquantizedLinearMethod(),
            dtype=router_dtype,
        )  # fmt: skip
        swiglu = None if cfg.swiglu_limit is None else (cfg.swiglu_alpha, cfg.swiglu_limit)
        grouped = None
        if cfg.moe_routing == "sigmoid":
            grouped = (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)
        self.experts = FusedMoE(
            cfg.num_experts, cfg.num_experts_per_tok, h, cfg.moe_intermediate_size,
            cfg.norm_topk_prob, dtype, _experts_method(method, f"{prefix}.experts", per_channel),
            shard, bias=cfg.moe_bias, swiglu=swiglu, grouped=grouped,
        )  # fmt: skip
        self.shared_expert: GatedMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if cfg.shared_expert_intermediate_size:
            shared = dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)
            self.shared_expert = GatedMLP(shared, f"{prefix}.shared_expert", method, dtype, ctx)
            self.shared_expert.down_proj.reduce = None  # summed with the experts' part below
            if cfg.shared_expert_gated:
                gate = Linear(h, 1, method=UnquantizedLinearMethod(), dtype=dtype)
                self.shared_expert_gate = gate

    def forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the block's output, x + residual)
        ungated = self.shared_expert is not None and self.shared_expert_gate is None
        if self.experts.routes_in_experts(x.shape[0]) and not ungated:
            # A decode step: the norm inside the router's projection (one kernel at one row)
            # and again, with the routing, inside the experts' first kernel; the shared
            # expert's projections norm their own input, its gated sum is the experts' last.
            logits, summed = norm_then_project(ops, self.gate, x, residual, norm_weight, eps)
            shared = None
            if self.shared_expert is not None and self.shared_expert_gate is not None:
                out, _ = self.shared_expert(ops, x, residual, norm_weight, eps)
                gate, _ = norm_then_project(
                    ops, self.shared_expert_gate, x, residual, norm_weight, eps
                )
                shared = (out, gate)
            routed = self.experts.forward_routed(ops, summed, norm_weight, eps, logits, shared)
            return routed, summed
        if norm_weight is None:
            normed = summed = x if residual is None else x + residual
        elif residual is None:
            normed, summed = ops.rms_norm(x, norm_weight, eps), x
        else:
            normed, summed = ops.fused_add_rms_norm(x, residual, norm_weight, eps)
        out = self.experts(ops, normed, self.gate(ops, normed.to(self.gate.weight.dtype)))
        if self.shared_expert is not None:
            shared, _ = self.shared_expert(ops, normed, None, None, eps)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(ops, normed)) * shared
            out = out + shared
        if self.reduce is not None:  # the ranks' parts: experts' slices or whole experts
            tp_all_reduce(self.reduce, out)
        return out, summed


def _experts_method(method: LinearMethodFactory, name: str, per_channel: bool) -> MoEMethod:
    """float8 experts (scales per expert, or `per_channel`) where the method gives the experts
    an FP8 method: "fp8-dynamic", or "fp8" with dummy weights' stand-in static scales (the
    experts' kernels scale their activations per token, so they need no calibrated ones); else
    (a calibrated static engine names no experts) the model dtype."""
    try:
        linear = method(name)
    except ModelLoadError:
        return UnquantizedMoEMethod()
    if isinstance(linear, Fp8LinearMethod):
        return Fp8MoEMethod(per_channel)
    if isinstance(linear, Fp8BlockLinearMethod):
        return Fp8BlockMoEMethod()
    if isinstance(linear, Int4LinearMethod):  # a pre-quantized INT4 checkpoint's, or dummy
        return Int4MoEMethod(linear.group_size, linear.needs_zeros)
    if isinstance(linear, Int8LinearMethod):  # W8A8 INT8: its experts' weights, weight-only
        return W8A16MoEMethod(torch.int8)
    if isinstance(linear, W8A16LinearMethod):
        if linear.group_size and linear.dtype != torch.int8:
            raise ModelLoadError(
                f"float8 weight-only experts in groups of {linear.group_size} inputs are not "
                "supported (kiln loads them per output channel)"
            )
        return W8A16MoEMethod(linear.dtype, linear.group_size)
    return UnquantizedMoEMethod()


# What a rank keeps of one expert's whole tensor: keep(layer, param, expert, whole) ->
# (name suffix, tensor) pairs stacked into f"{param}{suffix}"; [] for an expert it lacks.
KeepExpert = Callable[[int, str, int, torch.Tensor], list[tuple[str, torch.Tensor]]]


def stack_expert_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
    num_experts: int,
    parts: Mapping[str, tuple[str, int]],
    keep: KeepExpert | None = None,
    suffixes: Mapping[str, str] = _FLOAT8_SUFFIXES,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each layer's per-expert projections stacked into the
    experts' parameters: `parts` maps a projection's HF name ("w1", "gate_proj") to (the
    FusedMoE parameter, its row block: 0 gate, 1 up, 0 for down alone), yielded as
    model.layers.L.mlp.experts.<parameter> once every expert's blocks have come. `keep` (TP/EP:
    an ExpertShard's cut) takes each expert's whole tensor as soon as it is complete, so a rank
    holds only its part of the layer's experts; None keeps it whole. Other tensors pass
    through. `suffixes`: which stacked parameter each tensor of a projection loads into
    (its weight, <param>; its scales, <param>_scale; INT4's: INT4_SUFFIXES)."""
    blocks_of = {param: 1 + max(b for p, b in parts.values() if p == param) for param, _ in
                 parts.values()}  # fmt: skip
    blocks_of.update({f"{param}{suffix}": count for param, count in list(blocks_of.items())
                      for suffix in set(suffixes.values())})  # fmt: skip
    pending: dict[tuple[int, str], dict[tuple[int, int], torch.Tensor]] = {}
    kept: dict[tuple[int, str], dict[int, list[tuple[str, torch.Tensor]]]] = {}
    for name, tensor in weights:
        match = _EXPERT_RE.match(name)
        if match is None or match.group(3) not in parts or match.group(4) not in suffixes:
            yield name, tensor
            continue
        layer, expert = int(match.group(1)), int(match.group(2))
        if not 0 <= expert < num_experts:
            raise ModelLoadError(f"{name!r}: expert {expert} of a {num_experts}-expert model")
        param, block = parts[match.group(3)]
        param += suffixes[match.group(4)]  # a scale: by rows (expert_scale_rows), stacked alike
        got = pending.setdefault((layer, param), {})
        got[(expert, block)] = tensor
        if any((expert, b) not in got for b in range(blocks_of[param])):
            continue
        whole = torch.cat([got.pop((expert, b)) for b in range(blocks_of[param])])
        done = kept.setdefault((layer, param), {})
        done[expert] = [("", whole)] if keep is None else keep(layer, param, expert, whole)
        if len(done) < num_experts:
            continue
        del pending[(layer, param)], kept[(layer, param)]
        held = [done[e] for e in range(num_experts) if done[e]]
        for i, (suffix, _) in enumerate(held[0] if held else []):
            stacked = torch.stack([pieces[i][1] for pieces in held])
            yield f"model.layers.{layer}.mlp.experts.{param}{suffix}", stacked
    if pending:
        (layer, param), got = next(iter(pending.items()))
        have = len(got) + len(kept.get((layer, param), {})) * blocks_of[param]
        raise ModelLoadError(
            f"checkpoint lacks experts' tensors: layer {layer} {param} has {have} of "
            f"{num_experts * blocks_of[param]}"
        )


def adapt_expert_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    num_experts: int,
    parts: Mapping[str, tuple[str, int]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A MoE family's checkpoint as its model loads it: the experts stacked, and quantized
    where the model's experts are float8; under TP/EP each expert quantized whole, then cut to
    this rank's part before stacking. `model`: a DecoderForCausalLM (its layer_start)."""
    start = getattr(model, "layer_start", 0)
    params, layers = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            layers[start + int(index)] = module
            for param_name, param in module.named_parameters(recurse=False):
                params[f"model.layers.{start + int(index)}.{rest}.{param_name}"] = param

    def keep(layer: int, param: str, expert: int, whole: torch.Tensor):
        module = layers.get(layer)
        if module is None or module.shard is None:  # another stage's layer
            return []
        quantize = None
        if whole.element_size() > 1:  # a model-dtype expert into 8-bit experts: rounded whole
            quantize = expert_rounding(getattr(module, param, None),
                                       getattr(module, f"{param}_scale", None))  # fmt: skip
        return module.shard.keep(param, expert, whole, quantize)

    sharded = any(m.shard is not None for m in layers.values())
    if any(isinstance(m.method, Int4MoEMethod) for m in layers.values()):  # the checkpoint's
        # layout stacked as it is (under TP/EP each expert's part: ExpertShard.cut_expert)
        int4 = _plain_g_idx(weights, layers)
        return stack_expert_weights(int4, num_experts, parts, keep if sharded else None,
                                    suffixes=INT4_SUFFIXES)  # fmt: skip
    weights = expert_scale_rows(weights, layers, parts)
    if not sharded:  # one rank: whole experts
        return quantize_float8_experts(stack_expert_weights(weights, num_experts, parts), params)
    stacked = stack_expert_weights(_cut_stacked(weights, layers), num_experts, parts, keep)
    return quantize_float8_experts(stacked, params)


def expert_scale_rows(
    weights: Iterable[tuple[str, torch.Tensor]],
    layers: Mapping[int, FusedMoE],
    parts: Mapping[str, tuple[str, int]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """A pre-quantized checkpoint's per-expert weight scales as one row per weight row of the
    whole expert, what the experts' scale parameters stack: for block-scaled experts, per
    128x128 block ([rows / 128, in / 128]) repeated down the rows to [rows, in / 128]; else per
    channel ([rows, 1]) or per tensor (one value) to [rows]. A per-channel checkpoint's experts
    need per-channel parameters: loading them into one scale per expert is refused by its
    shape."""
    for name, tensor in weights:
        match = _EXPERT_RE.match(name)
        module = None if match is None else layers.get(int(match.group(1)))
        if match is None or match.group(4) == "weight" or match.group(3) not in parts:
            yield name, tensor
            continue
        if module is None:  # another pipeline stage's layer: dropped as its weights are
            yield name, tensor
            continue
        param = parts[match.group(3)][0]
        full = module.intermediate_size if module.shard is None else module.shard.full_width
        rows = full if param.startswith("w13") else module.hidden_size
        block_scaled = getattr(module, f"{param}_scale").dim() == 3
        if block_scaled and tensor.dim() == 2 and tensor.shape[0] == rows:  # W8A16's groups of
            yield name, tensor.float()  # 128 inputs: a row each already
        elif block_scaled:  # block-scaled experts: [rows / 128, in / 128] (or one)
            blocks = tensor.float().reshape(-(-rows // FP8_BLOCK), -1)
            yield name, rows_of(blocks, rows)
        elif tensor.numel() == 1:
            yield name, tensor.float().reshape(()).expand(rows).clone()
        else:
            yield name, tensor.float().reshape(-1)


def _plain_g_idx(
    weights: Iterable[tuple[str, torch.Tensor]], layers: Mapping[int, FusedMoE]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors without its INT4 experts' g_idx, each checked to put input k
    in group k // group_size (GPTQ without desc_act: the experts' kernels read groups in input
    order); act-order experts are refused."""
    group = next(
        m.method.group_size for m in layers.values() if isinstance(m.method, Int4MoEMethod)
    )
    for name, tensor in weights:
        if _EXPERT_G_IDX_RE.match(name) is None:
            yield name, tensor
            continue
        plain = torch.arange(tensor.numel(), device=tensor.device) // (group or tensor.numel())
        if not torch.equal(tensor.long().reshape(-1), plain):
            raise ModelLoadError(
                f"{name}: INT4 experts quantized with act-order (GPTQ desc_act) are not "
                "supported; quantize with desc_act=False"
            )


def expert_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The experts' parameters of a DecoderForCausalLM by their HF names (its layer_start
    added): model.layers.L.mlp.experts.<parameter>."""
    start = getattr(model, "layer_start", 0)
    params: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if name.startswith("layers.") and ".experts." in name:
            index, rest = name.removeprefix("layers.").split(".", 1)
            params[f"model.layers.{start + int(index)}.{rest}"] = param
    return params


def _cut_stacked(
    weights: Iterable[tuple[str, torch.Tensor]], layers: Mapping[int, FusedMoE]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint's experts that come already stacked (model.layers.L.mlp.experts.<param>,
    as a family's own adapter yields them), cut to this rank's part (TP/EP); other tensors
    pass through (the per-expert ones are cut as they stack)."""
    for name, tensor in weights:
        match = _STACKED_RE.match(name)
        module = layers.get(int(match.group(1))) if match else None
        if match is not None and module is not None and module.shard is not None:
            tensor = module.shard.cut_stacked(match.group(2), tensor)
        yield name, tensor


def cut_stacked_experts(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """A family's experts that its adapter yields stacked and whole (gpt-oss's), float8 ones
    quantized whole, cut to this rank's part under TP/EP (as adapt_expert_weights cuts each
    expert): the float8 bytes and scales every rank holds equal the one-process model's.
    `model`: a DecoderForCausalLM (its layer_start)."""
    start = getattr(model, "layer_start", 0)
    layers = {
        start + int(name.split(".")[1]): module
        for name, module in model.named_modules()
        if isinstance(module, FusedMoE) and name.startswith("layers.")
    }
    return _cut_stacked(weights, layers)


def quantize_float8_experts(
    weights: Iterable[tuple[str, torch.Tensor]], params: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stacked experts' tensors (stack_expert_weights's) in the model dtype whose parameter in
    `params` (the model's, by HF name) is float8 or int8: quantized, each followed by its
    scale (int8: per channel, W8A16MoEMethod's)."""
    for name, tensor in weights:
        rounding = expert_rounding(params.get(name), params.get(f"{name}_scale"))
        if rounding is None or tensor.element_size() == 1:
            yield name, tensor
            continue
        codes, scale = rounding(tensor)
        yield name, codes
        yield f"{name}_scale", scale


def expert_rounding(param: torch.Tensor | None, scale: torch.Tensor | None) -> Quantize | None:
    """How a model-dtype expert tensor rounds into 8-bit expert parameter `param` given its
    `scale` parameter's shape: int8 per channel or per GROUP inputs (3-D scales), float8 per
    128x128 block (3-D), per channel (2-D) or per expert; None for any other parameter."""
    if param is None or param.dtype not in (torch.float8_e4m3fn, torch.int8):
        return None
    scale_dims = 0 if scale is None else scale.dim()
    if param.dtype == torch.int8:
        return functools.partial(
            quantize_experts_w8, dtype=torch.int8, group_size=GROUP if scale_dims == 3 else 0
        )
    if scale_dims == 3:
        return quantize_experts_fp8_block
    return functools.partial(quantize_experts_fp8, per_channel=scale_dims == 2)


# The experts' stacked parameters, loaded whole (as stack_expert_weights names them).
EXPERT_TENSOR_MAP = {
    "mlp.gate.weight": ("mlp.gate.weight", None),
    "mlp.experts.w13_weight": ("mlp.experts.w13_weight", None),
    "mlp.experts.w2_weight": ("mlp.experts.w2_weight", None),
    "mlp.experts.w13_weight_scale": ("mlp.experts.w13_weight_scale", None),
    "mlp.experts.w2_weight_scale": ("mlp.experts.w2_weight_scale", None),
    "mlp.experts.w13_weight_scales": ("mlp.experts.w13_weight_scales", None),
    "mlp.experts.w2_weight_scales": ("mlp.experts.w2_weight_scales", None),
    "mlp.experts.w13_weight_zeros": ("mlp.experts.w13_weight_zeros", None),
    "mlp.experts.w2_weight_zeros": ("mlp.experts.w2_weight_zeros", None),
    "mlp.experts.w13_bias": ("mlp.experts.w13_bias", None),
    "mlp.experts.w2_bias": ("mlp.experts.w2_bias", None),
}
