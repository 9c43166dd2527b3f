"""Layer-sequential GPTQ (as AutoGPTQ and llm-compressor run it): decoder layer i's projections
are rounded from the inputs they see in a model whose layers 0..i-1 and whose earlier
projections of layer i are already float8, so each compensates the error its inputs really
carry, not the source model's clean inputs.

The calibration windows run as one packed prefill through one decoder layer at a time (the
hidden states between layers are kept, so the whole pass costs about two forwards of the model,
not one per layer): first the source's layer i, recording each projection's input X (the
target the engine should reproduce), then the same layer with each projection replaced, on
first sight of its input, by its float8 rounding, whose output (the engine's own fp8_linear
arithmetic) feeds the next projection and the next layer.

Returns each projection's float8 codes and scales; the build loads them as they are
(Fp8LinearMethod's `rounded`), instead of rounding the source's weights as they arrive.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from types import ModuleType

import torch

from kiln.kernels.reference import quantize_fp8
from kiln.layers.linear import Linear, LinearMethod

# The attention types through the model that takes them: quantization sits above models, not
# beside attention (tests/test_layering.py).
from kiln.models.blocks import AttentionBackend, AttentionMetadata, DecoderLayer, StepInputs
from kiln.models.decoder import DecoderForCausalLM
from kiln.models.packed_prefill import packed_prefill_metadata
from kiln.quantization import gptq

_BLOCK_SIZE = 16  # the calibration's own KV cache's block size (any works: one prefill)


@dataclass(frozen=True)
class RoundingSpec:
    """How each projection rounds from the inputs it sees."""

    aware: bool
    """True: the activation-aware target (gptq.activation_aware_weight) against the source's
    inputs X, GPTQ with H = Xq Xq^T; False: plain GPTQ of W."""
    quantized_input: bool = True
    """(not aware) H = xq xq^T of the float8 inputs the engine multiplies; False: x x^T of the
    inputs seen, before their quantization."""
    damp: float = gptq._DAMP
    act_order: bool = False


def round_sequentially(
    model: DecoderForCausalLM,
    ops: ModuleType,
    backend: AttentionBackend,
    token_batches: list[list[int]],
    spec: RoundingSpec,
    input_scales: dict[str, float] | None,
    kept: Collection[str] = (),
    on_layer: Callable[[], None] | None = None,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Layer name -> (float8 codes [out, in], fp32 scales [out, 1]) of every decoder projection
    of `model` (unquantized, TP=1 and one pipeline stage), rounded layer after layer over
    `token_batches` (each one sequence). `input_scales` (layer name -> static scale): the
    engine's inputs quantize with them ("fp8"); None: per token ("fp8-dynamic"). `kept`: layer
    names the engine keeps unquantized (--unquantized-layers): they run as the source's.
    `on_layer`, if given, is called as each decoder layer is done (a build's progress)."""
    if model.parallel is not None:
        raise ValueError("layer-sequential rounding runs the whole model in one process")
    device = model.device
    step = _packed_prefill(model, token_batches, device)
    source = model.embed_tokens(step.input_ids)
    engine = source.clone()
    source_residual = engine_residual = None
    rounded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for index, layer in enumerate(model.layers):
        projections = _projections(layer, f"layers.{model.layer_start + index}")
        recorders = {name: _Recorder(p.method) for name, p in projections.items()}
        with _wrapped(projections, recorders):
            source, source_residual = _layer_forward(
                model, layer, ops, backend, source, source_residual, step
            )
        rounders = {
            name: _Rounder(
                p.method, spec, recorders[name].x if spec.aware else None,
                None if input_scales is None else input_scales[name],
            )
            for name, p in projections.items()
            if name not in kept
        }  # fmt: skip
        del recorders
        with _wrapped(projections, rounders):
            engine, engine_residual = _layer_forward(
                model, layer, ops, backend, engine, engine_residual, step
            )
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


def _packed_prefill(
    model: DecoderForCausalLM, token_batches: list[list[int]], device: torch.device
) -> _Step:
    """Every window as one sequence of one prefill step, each in its own blocks."""
    cfg = model.config
    lens = [len(b) for b in token_batches]
    if not lens or min(lens) == 0:
        raise ValueError("layer-sequential rounding needs non-empty calibration windows")
    metadata, first = packed_prefill_metadata(lens, _BLOCK_SIZE, device)
    shape = (first, _BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
    dtype = model.dtype
    return _Step(
        input_ids=torch.tensor([t for b in token_batches for t in b], device=device),
        positions=torch.cat([torch.arange(n) for n in lens]).to(device),
        metadata=metadata,
        k_cache=torch.zeros(shape, dtype=dtype, device=device),
        v_cache=torch.zeros(shape, dtype=dtype, device=device),
    )


def _layer_forward(
    model: DecoderForCausalLM,
    layer: DecoderLayer,
    ops: ModuleType,
    backend: AttentionBackend,
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    step: _Step,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer, through the layer's own forward (its block, not a copy of it)."""
    inputs = StepInputs(ops, backend, step.positions, model.cos_sin_cache, step.metadata)
    return layer(inputs, hidden, residual, (step.k_cache, step.v_cache))


def _projections(layer: DecoderLayer, prefix: str) -> dict[str, Linear]:
    """Layer name (as linear_method_factory takes it) -> projection."""
    return {
        f"{prefix}.{name}": module
        for name, module in layer.named_modules()
        if isinstance(module, Linear)
    }


class _wrapped:
    """Installs `methods` (name -> wrapping method) on `projections` for a with-block."""

    def __init__(self, projections: dict[str, Linear], methods: dict[str, LinearMethod]):
        self.pairs = [(projections[n], m) for n, m in methods.items()]

    def __enter__(self) -> None:
        for module, method in self.pairs:
            module.method = method

    def __exit__(self, *exc: object) -> None:
        for module, method in self.pairs:
            module.method = method.inner


class _Recorder(LinearMethod):
    """The wrapped method's arithmetic; keeps its (whole packed) input."""

    def __init__(self, inner: LinearMethod) -> None:
        self.inner = inner
        self.x: torch.Tensor | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        self.x = x.reshape(-1, x.shape[-1])
        return self.inner.apply(layer, ops, x)


class _Rounder(LinearMethod):
    """On its one call (the packed prefill): rounds the layer's weight from the input it is
    given, then answers as the float8 engine would (ops.fp8_linear with those codes)."""

    def __init__(
        self,
        inner: LinearMethod,
        spec: RoundingSpec,
        source_x: torch.Tensor | None,
        input_scale: float | None,
    ) -> None:
        self.inner, self.spec, self.source_x = inner, spec, source_x
        self.input_scale = input_scale
        self.result: tuple[torch.Tensor, torch.Tensor] | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        raise RuntimeError("an observing method wraps a built layer")

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        if self.result is not None:
            raise RuntimeError("layer-sequential rounding runs each layer once")
        rows = x.reshape(-1, x.shape[-1]).float()
        weight = layer.weight.detach().float()
        scale = None
        if self.input_scale is not None:
            scale = torch.tensor(self.input_scale, dtype=torch.float32, device=x.device)
        n = rows.shape[0]
        if self.spec.aware or self.spec.quantized_input:
            q8, s = quantize_fp8(rows, scale)
            xq = q8.float() * s
            hessian = xq.T @ xq / n
        else:
            hessian = rows.T @ rows / n
        if self.spec.aware:
            cross = self.source_x.float().T @ xq / n
            weight = gptq.activation_aware_weight(weight, cross, hessian, self.spec.damp)
        codes, wscale = gptq.gptq_fp8(weight, hessian, self.spec.damp, self.spec.act_order)
        self.result = (codes, wscale)
        self.source_x = None
        return ops.fp8_linear(x, codes, wscale.view(-1), scale, layer.bias)
