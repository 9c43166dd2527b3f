"""Layer-sequential GPTQ (as AutoGPTQ and llm-compressor run it): decoder layer i's projections
are rounded from the inputs they see in a model whose layers 0..i-1 and whose earlier
projections of layer i are already float8, so each compensates the error its inputs really
carry, not the source model's clean inputs.

The calibration windows run as one packed prefill through one decoder layer at a time, through
the layer's own forward (the hidden states between layers are kept, so the whole pass costs
about one forward of the model, not one per layer): each projection is replaced, on first sight
of its input, by its float8 rounding, whose output (the engine's own fp8_linear arithmetic)
feeds the next projection and the next layer.

Returns each projection's float8 codes and scales; the build loads them as they are
(Fp8LinearMethod's `rounded`), instead of rounding the source's weights as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.builder.calibrate import gptq
from kiln.builder.calibrate.calibration import WrappingMethod
from kiln.kernels.kv_layout import empty_cache
from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.models.base import CausalLM
from kiln.models.blocks import DecoderLayer, decoder_layers
from kiln.models.packed_prefill import packed_prefill_metadata

_BLOCK_SIZE = 16  # the calibration's own KV cache's block size (any works: one prefill)


@dataclass(frozen=True)
class RoundingSpec:
    """How each projection rounds from the inputs it sees."""

    quantized_input: bool = True
    """H = xq xq^T of the float8 inputs the engine multiplies; False: x x^T of the inputs seen,
    before their quantization."""
    damp: float = gptq.DAMP
    act_order: bool = False


def round_sequentially(
    model: CausalLM,
    ops: ModuleType,
    backend: AttentionBackend,
    token_batches: list[list[int]],
    spec: RoundingSpec,
    input_scales: dict[str, float] | None,
    kept: Collection[str] = (),
    on_layer: Callable[[], object] | None = None,
    make_rounder: Callable[[LinearMethod], Any] | None = None,
) -> dict[str, tuple[torch.Tensor, ...]]:
    """Layer name -> (float8 codes [out, in], fp32 scales [out, 1]) of every decoder projection
    of `model` (unquantized, TP=1 and one pipeline stage), rounded layer after layer over
    `token_batches` (each one sequence). `input_scales` (layer name -> static scale): the
    engine's inputs quantize with them ("fp8"); None: per token ("fp8-dynamic"). `kept`: layer
    names the engine keeps unquantized (--unquantized-layers): they run as the source's.
    `on_layer`, if given, is called as each decoder layer is done (a build's progress).
    `make_rounder`: another rounding than float8's (a WrappingMethod with a `result` after its
    one call: kiln.builder.calibrate.int4.Int4Rounder), from the layer's method."""
    if model.parallel is not None:
        raise ValueError("layer-sequential rounding runs the whole model in one process")
    step = _packed_prefill(model, token_batches)
    inputs = model.step_inputs(ops, backend, step.positions, step.metadata)
    hidden, residual, hidden_norm = model.embed(step.input_ids), None, None
    rounded: dict[str, tuple[torch.Tensor, ...]] = {}
    for index, layer in enumerate(decoder_layers(model)):
        projections = _projections(layer, f"layers.{model.layer_start + index}")
        rounders: dict[str, Any] = {
            name: make_rounder(p.method)
            if make_rounder is not None
            else _Rounder(p.method, spec, None if input_scales is None else input_scales[name])
            for name, p in projections.items()
            if name not in kept
        }
        with _wrapped(projections, rounders):
            hidden, residual = layer(
                inputs, hidden, residual, (step.k_cache, step.v_cache), None, hidden_norm
            )
        hidden_norm = layer.output_norm
        for name, rounder in rounders.items():
            if rounder.result is None:
                raise ValueError(f"calibration saw no input to {name!r}")
            rounded[name] = rounder.result
        if on_layer is not None:
            on_layer()
    return rounded


@dataclass
class _Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    k_cache: torch.Tensor  # one layer's, reused by every layer (each layer's pass is whole)
    v_cache: torch.Tensor


def _packed_prefill(model: CausalLM, token_batches: list[list[int]]) -> _Step:
    """Every window as one sequence of one prefill step, each in its own blocks."""
    cfg, device = model.config, model.device
    lens = [len(b) for b in token_batches]
    if not lens or min(lens) == 0:
        raise ValueError("layer-sequential rounding needs non-empty calibration windows")
    metadata, first = packed_prefill_metadata(lens, _BLOCK_SIZE, device)
    shape = (first, _BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    # Head-major, as the engine's cache: the Triton kernels take no other layout.
    k_cache, v_cache = (empty_cache(*shape, model.dtype, device) for _ in "kv")
    return _Step(
        input_ids=torch.tensor([t for b in token_batches for t in b], device=device),
        positions=torch.cat([torch.arange(n) for n in lens]).to(device),
        metadata=metadata,
        k_cache=k_cache,
        v_cache=v_cache,
    )


def _projections(layer: DecoderLayer, prefix: str) -> dict[str, Linear]:
    """Layer name (as linear_method_factory takes it) -> projection."""
    return {
        f"{prefix}.{name}": module
        for name, module in layer.named_modules()
        if isinstance(module, Linear)
    }


class _wrapped:
    """Installs `methods` (name -> wrapping method) on `projections` for a with-block."""

    def __init__(self, projections: dict[str, Linear], methods: Mapping[str, WrappingMethod]):
        self.pairs = [(projections[n], m) for n, m in methods.items()]

    def __enter__(self) -> None:
        for module, method in self.pairs:
            module.method = method

    def __exit__(self, *exc: object) -> None:
        for module, method in self.pairs:
            module.method = method.inner


class _Rounder(WrappingMethod):
    """On its one call (the packed prefill): rounds the layer's weight from the input it is
    given, then answers as the float8 engine would (ops.fp8_linear with those codes)."""

    def __init__(self, inner: LinearMethod, spec: RoundingSpec, input_scale: float | None) -> None:
        self.inner, self.spec, self.input_scale = inner, spec, input_scale
        self.result: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if self.result is not None:
            raise RuntimeError("layer-sequential rounding runs each layer once")
        rows = x.reshape(-1, x.shape[-1]).float()
        scale = None
        if self.input_scale is not None:
            scale = torch.tensor(self.input_scale, dtype=torch.float32, device=x.device)
        if self.spec.quantized_input:
            q8, s = quantize_fp8(rows, scale)
            rows = q8.float() * s
        hessian = rows.T @ rows / rows.shape[0]
        weight = layer.weight.detach().float()
        codes, wscale = gptq.gptq_fp8(weight, hessian, self.spec.damp, self.spec.act_order)
        self.result = (codes, wscale)
        return ops.fp8_linear(x, codes, wscale.view(-1), scale, layer.bias)
