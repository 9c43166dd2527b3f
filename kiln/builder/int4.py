"""`kiln build --quantization int4-gptq | int4-awq`: INT4 W4A16 engines, asymmetric codes in groups
of 128 inputs with zero points (kiln.builder.calibrate.int4 rounds them), written in the layout
Int4LinearMethod loads ("int4-g128" in the manifest), checked by the build's accuracy check.

Both round on the source `LLM` while its perplexity is measured, from the calibration text:
int4-gptq layer after layer (each layer's GPTQ from the inputs of a model whose earlier layers
are INT4 already), int4-awq from one pass's input statistics (its factors fold into the norms,
v_proj and up_proj exactly as SmoothQuant's do: kiln.builder.calibrate.smoothing, whose
smooth_checkpoint the engine's weights stream through). The engine's model then loads the
source with RoundedInt4Method, which takes each projection's rounded codes instead of the
source's weight."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch

from kiln.builder.calibrate import int4 as rounding
from kiln.errors import BuildError
from kiln.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from kiln.layers.quantization.int4 import Int4LinearMethod

if TYPE_CHECKING:
    from kiln.llm import LLM
    from kiln.models.base import CausalLM
    from kiln.models.config import ModelConfig

INT4_BUILDS = {
    "int4-gptq": "INT4 weights (asymmetric, groups of 128 inputs, or 64 / 32 where 128 does not "
    "divide them, with zero points) rounded by GPTQ layer after layer on the calibration text; "
    "activations in the model dtype",
    "int4-awq": "INT4 weights (asymmetric, groups of 128 inputs, or 64 / 32 where 128 does not "
    "divide them, with zero points): AWQ's per-channel scales (alpha searched per projection) "
    "folded into the norms, v_proj and up_proj, ranges clipped by AWQ's search, rounded to "
    "nearest; activations in the model dtype",
}


def group_size(cfg: ModelConfig) -> int:
    """128 inputs a group, as the tools default to, or the largest of 64 and 32 that divides
    every projection's inputs (SmolLM2's hidden size 576 is 9 groups of 64)."""
    inputs = (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.intermediate_size)
    for size in (rounding.GROUP_SIZE, 64, 32):
        if all(k % size == 0 for k in inputs):
            return size
    raise BuildError(f"INT4: no group of 128, 64 or 32 inputs divides {inputs}")


def engine_quantization(quantization: str, cfg: ModelConfig) -> str:
    """The scheme an engine's manifest names (what its model is built with)."""
    return f"int4-g{group_size(cfg)}" if quantization in INT4_BUILDS else quantization


def round_int4(
    llm: LLM, text: str, quantization: str, kept: Collection[str]
) -> tuple[dict[str, rounding.Int4Weights], dict[str, torch.Tensor] | None]:
    """(layer name -> its INT4 codes, scales and zeros; AWQ's factors, for smooth_checkpoint, or
    None) of `llm`'s unquantized model, from `text`."""
    from kiln.builder.progress import build_step
    from kiln.builder.quantize import SEQUENTIAL_WINDOWS, _source_runner, calibration_batches
    from kiln.sampling_params import SamplingParams

    if llm.get_tokenizer() is None:
        raise BuildError(f'quantization "{quantization}" calibrates on text: no tokenizer')
    runner = _source_runner(llm)
    model = runner.model
    if model.config.num_experts:
        raise BuildError(
            f"{quantization}: kiln build does not round mixture-of-experts experts to INT4 yet; "
            "load a GPTQ / AWQ / compressed-tensors INT4 MoE checkpoint as it is"
        )
    group = group_size(model.config)
    batches = calibration_batches(llm, text, SEQUENTIAL_WINDOWS)
    if quantization == "int4-gptq":
        from kiln.builder.calibrate.sequential import RoundingSpec, round_sequentially

        step = build_step("rounding weights (int4 gptq)", len(model.layers), " layers")
        with torch.no_grad(), step as bar:
            rounded = round_sequentially(
                model, runner.ops, runner.backend, batches, RoundingSpec(), None, kept,
                on_layer=lambda: bar.update(1),
                make_rounder=lambda method: rounding.Int4Rounder(method, group),
            )  # fmt: skip
        return {name: (w[0], w[1], w[2]) for name, w in rounded.items()}, None
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    with build_step("calibrating (awq statistics)", len(batches), " windows") as bar:
        stats = rounding.calibrate_activations(model, batches, lambda b: llm.generate(b, one_token))
        bar.update(len(batches))
    with torch.no_grad(), build_step("awq search", len(model.layers), " layers") as bar:
        return awq_layers(model, stats, kept, group, on_layer=lambda: bar.update(1))


def awq_layers(
    model: CausalLM,
    stats: dict[str, tuple[torch.Tensor, torch.Tensor]],
    kept: Collection[str] = (),
    group: int = rounding.GROUP_SIZE,
    on_layer: Callable[[], object] | None = None,
) -> tuple[dict[str, rounding.Int4Weights], dict[str, torch.Tensor]]:
    """AWQ on every decoder layer of `model` (unquantized, one process): each projection's
    factors (o_proj's equal over the query heads that share a KV head, as their fold into v_proj
    needs), then each projection's smoothed weight (columns times its factors; v's and up's rows
    divided by o_proj's and down_proj's) clipped and rounded, its inputs' statistics divided
    likewise."""
    from kiln.builder.calibrate.smoothing import _kv_group_max, _per_kv_row
    from kiln.models.blocks import GatedMLP, decoder_layers

    if model.parallel is not None or not getattr(model, "supports_smoothing", True):
        raise BuildError(
            f"int4-awq folds its factors into Llama-shaped RMSNorm layers; "
            f"{model.config.architecture}'s norms or checkpoint names differ"
        )
    cfg = model.config
    factors: dict[str, torch.Tensor] = {}
    rounded: dict[str, rounding.Int4Weights] = {}
    for i, layer in enumerate(decoder_layers(model)):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP):
            raise BuildError(f"int4-awq folds into a gated MLP, not {type(mlp).__name__}")
        projections = {
            f"layers.{i}.self_attn.qkv_proj": attn.qkv_proj,
            f"layers.{i}.self_attn.o_proj": attn.o_proj,
            f"layers.{i}.mlp.gate_up_proj": mlp.gate_up_proj,
            f"layers.{i}.mlp.down_proj": mlp.down_proj,
        }
        weights = {n: p.weight.detach().float().cpu() for n, p in projections.items()}
        for name, weight in weights.items():
            hessian, mean = stats[name]
            if name.endswith("o_proj"):
                mean = _kv_group_max(mean, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            factors[name], _ = rounding.awq_scale(weight, hessian, mean, group)
        qkv, o, gate_up, down = weights
        smoothed = {name: w * factors[name] for name, w in weights.items()}
        v_rows = slice(attn.q_size + attn.kv_size, None)
        smoothed[qkv][v_rows] /= _per_kv_row(factors[o], cfg)[:, None]
        smoothed[gate_up][mlp.intermediate_size :] /= factors[down][:, None]
        for name, weight in smoothed.items():
            if name in kept:
                continue
            s = factors[name]
            hessian = stats[name][0] / (s[:, None] * s[None, :])
            # AutoAWQ's: q and k are not clipped (the softmax is more sensitive to them than
            # their outputs' error says); one search per projection, so qkv is not clipped.
            clip = None if name.endswith("qkv_proj") else hessian
            rounded[name] = rounding.clip_int4(weight, clip, group)
        if on_layer is not None:
            on_layer()
    return rounded, factors


class RoundedInt4Method(Int4LinearMethod):
    """A build's INT4 method: the source's weight (fp32 rows of a fused shard) is replaced by
    the rounded codes, scales and zeros of the whole fused layer, the shard's rows of each."""

    def __init__(self, weights: rounding.Int4Weights) -> None:
        codes, scales, _ = weights
        super().__init__(codes.shape[1] // scales.shape[1])
        self.packed = rounding.pack(weights)

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        if param is layer.weight:  # the source's unpacked rows
            return (shape[0], shape[1] * 8)
        return shape

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        if param is not layer.weight:
            super().load_checkpoint_tensor(layer, param, shard, loaded)
            return
        targets = (layer.weight, layer.weight_scales, layer.weight_zeros)
        for target, name, value in zip(targets, ("weight", "weight_scales", "weight_zeros"),
                                       self.packed):  # fmt: skip
            layer.shard_view(target, shard).copy_(layer.shard_view(value, shard))
            self._loaded.add((name, shard))


def build_factory(
    rounded: dict[str, rounding.Int4Weights], kept: Collection[str]
) -> Callable[[str], LinearMethod]:
    """The build model's linear methods: each projection's rounded INT4, kept ones unquantized."""

    def method(name: str) -> LinearMethod:
        if name in kept:
            return UnquantizedLinearMethod()
        if name not in rounded:
            raise BuildError(f"int4: no rounded weights for layer {name!r}")
        return RoundedInt4Method(rounded[name])

    return method
