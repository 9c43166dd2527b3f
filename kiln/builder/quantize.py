"""A quantized build's two passes over the source: the unquantized source runs as an `LLM` (its
perplexity for the accuracy check, and for static "fp8" the activations that calibrate each
projection's input scale: kiln.builder.calibrate), then the weights load again into a model made
with the scheme's linear methods, which quantize each tensor as it arrives."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from kiln.builder.int4 import INT4_BUILDS
from kiln.builder.progress import build_step
from kiln.errors import BuildError
from kiln.layers.quantization.outlier_columns import choose_channels

if TYPE_CHECKING:  # options.py imports this module
    from kiln.builder.options import BuildOptions
    from kiln.builder.prequantized import Scores
    from kiln.llm import LLM
    from kiln.models.kv_scales import KVHeadScales
    from kiln.runtime.model_runner import ModelRunner

_CALIBRATION_TOKENS = 512
_CALIBRATION_BATCHES = 8
# "gptq-sequential"'s own: 32 windows (16,384 tokens) and damp 0.1 of H's mean diagonal. On
# SmolLM2 fp8-dynamic, 8 windows and damp 0.01 read +1.60% on the build's held-out article (+2.03%
# on three), 32 and 0.1 +0.86% (+0.57%); either alone did not help on three articles.
SEQUENTIAL_WINDOWS = 32
SEQUENTIAL_DAMP = 0.1
SCALES_METHOD = {
    "fp8": "static per-tensor input scales calibrated at build time; per-channel weights",
    "fp8-dynamic": "dynamic per-token input scales; per-channel weights",
    "int8-w8a8": "int8: dynamic per-token input scales; per-channel weights rounded to nearest",
    "fp8-block": "dynamic input scales per group of 128 inputs; a weight scale per 128x128 block",
    "int8-w8a16-channel": "weight-only int8, per-channel scales, rounded to nearest",
    "int8-w8a16-g128": "weight-only int8, a scale per group of 128 inputs, rounded to nearest",
    "int8-w8a16-g16": "weight-only int8, a scale per group of 16 inputs, rounded to nearest",
    "fp8-w8a16-channel": "weight-only float8, per-channel scales, rounded to nearest",
    **INT4_BUILDS,
}

# "gptq": H = X X^T of the source's inputs, one pass (kiln.builder.calibrate.gptq).
# "gptq-sequential": layer after layer, from the inputs of the model whose earlier layers are
# float8 already (kiln.builder.calibrate.sequential).
WEIGHT_ROUNDINGS = ("nearest", "gptq", "gptq-sequential")

__all__ = [
    "SCALES_METHOD",
    "SEQUENTIAL_DAMP",
    "SEQUENTIAL_WINDOWS",
    "WEIGHT_ROUNDINGS",
    "SourcePass",
    "calibrate",
    "calibration_batches",
    "gptq_rounders",
    "round_weights",
    "run_source",
    "smooth_source",
    "text_hash",
]


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


class _InProcess(Protocol):
    runner: ModelRunner


def _source_runner(llm: LLM) -> ModelRunner:
    """The model runner of the build's source `LLM`, which runs in this process on one device
    (accuracy.measuring_llm): the calibrations wrap its model's projections."""
    return cast(_InProcess, llm.engine.executor).runner


def calibration_batches(
    llm: LLM, text: str, batches: int = _CALIBRATION_BATCHES
) -> list[list[int]]:
    """The calibration windows: the first `batches` windows of `text`'s tokens, sharing no
    prefix (the engine's prefix cache would skip repeated ones)."""
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None, "the callers refuse a source without a tokenizer"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # A window and its one generated token must fit the model's context.
    n = min(_CALIBRATION_TOKENS, llm.engine.max_model_len - 1)
    return [ids[i : i + n] for i in range(0, len(ids), n)][:batches]


def smooth_source(
    llm: LLM, path: str, text: str, smoothing: str, load_format: str = "auto"
) -> dict:
    """Smooth `llm`'s unquantized model in place (kiln.builder.calibrate.smoothing): its inputs'
    per-channel amax over the calibration windows of `text`, the factors from them and the
    weights, then the source's weights (read from `path` again) loaded through the same
    smooth_checkpoint the engine's weights go through. Returns the factors (layer name ->
    [in_features]), for the engine's weights."""
    from kiln.builder.calibrate.calibration import calibrate_channel_amax
    from kiln.builder.calibrate.smoothing import (
        SmoothingSpec,
        smooth_checkpoint,
        smoothing_factors,
    )
    from kiln.runtime.model_loader import find_model_source
    from kiln.sampling_params import SamplingParams

    if llm.get_tokenizer() is None:
        raise BuildError(f'smoothing "{smoothing}" calibrates on text: the source has no tokenizer')
    model = _source_runner(llm).model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    batches = calibration_batches(llm, text)
    with build_step("smoothing: channel amax", len(batches), " windows") as bar:
        amax = calibrate_channel_amax(model, batches, lambda b: llm.generate(b, one_token))
        bar.update(len(batches))
    alpha = SmoothingSpec.parse(smoothing).alpha
    assert alpha is not None, "called for smoothquant, whose alpha has a default"
    factors = smoothing_factors(model, amax, alpha)
    source = find_model_source(path, load_format)
    assert source.weights is not None, "a checkpoint, not dummy weights"
    with build_step("smoothing: reloading the source"):
        model.load_weights(smooth_checkpoint(source.weights, factors, model.config))
    return factors


def calibrate(
    llm: LLM,
    text: str,
    input_scales: bool,
    kv_scales: bool,
    hessians: bool = False,
    channel_amax: bool = False,
) -> tuple[dict[str, float] | None, list[tuple[float, float]] | None, dict | None, dict | None]:
    """(static input scales, layer name -> absmax / 448, if `input_scales`; per-layer float8 KV
    cache scales if `kv_scales`; layer name -> GPTQ's input statistics if `hessians`; layer
    name -> each input channel's absmax if `channel_amax`) from `llm`'s unquantized model run
    over the first tokens of `text`, in windows that share no prefix (the engine's prefix cache
    would skip repeated ones), in one pass: each observer wraps the ones before it."""
    from kiln.builder.calibrate.calibration import calibrate_channel_amax, calibrate_input_scales
    from kiln.builder.calibrate.gptq import calibrate_hessians
    from kiln.builder.calibrate.kv_scales import calibrate_kv_scales
    from kiln.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    if tokenizer is None:  # calibration text needs the model's tokenizer
        if input_scales or hessians or channel_amax:
            raise BuildError(
                'quantization "fp8", GPTQ weight rounding and outlier columns calibrate on '
                "text: the source has no tokenizer"
            )
        print("the source has no tokenizer: its float8 KV cache stays unscaled", flush=True)
        return None, None, None, None
    batches = calibration_batches(llm, text)
    model = _source_runner(llm).model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    wanted = (
        ("kv", calibrate_kv_scales, kv_scales),
        ("scales", calibrate_input_scales, input_scales),
        ("hessians", calibrate_hessians, hessians),
        ("channels", calibrate_channel_amax, channel_amax),
    )
    calibrators = [(key, calibrator) for key, calibrator, want in wanted if want]
    found: dict[str, Any] = {}  # by key: each calibrator's own result type

    def nest(depth: int, b: list[list[int]]) -> None:
        """Each calibrator wraps the layers' methods, then runs the next one inside: every
        observer sees the same single pass over the text."""
        if depth == len(calibrators):
            llm.generate(b, one_token)
            return
        key, calibrator = calibrators[depth]
        found[key] = calibrator(model, b, lambda inner: nest(depth + 1, inner))

    what = ", ".join(key for key, _ in calibrators)
    with build_step(f"calibrating ({what})", len(batches), " windows") as bar:
        nest(0, batches)
        bar.update(len(batches))
    return found.get("scales"), found.get("kv"), found.get("hessians"), found.get("channels")


def round_weights(
    llm: LLM,
    text: str,
    input_scales: dict[str, float] | None,
    kept: list[str],
) -> dict[str, tuple]:
    """ "gptq-sequential"'s float8 weights, rounded layer after layer through `llm`'s unquantized
    model over SEQUENTIAL_WINDOWS calibration windows of `text` (the `kept` projections stay
    unquantized in it). `input_scales`: the static scales the engine's inputs quantize with,
    None per token."""
    from kiln.builder.calibrate.sequential import RoundingSpec, round_sequentially

    if llm.get_tokenizer() is None:
        raise BuildError(
            'weight rounding "gptq-sequential" calibrates on text: the source has no tokenizer'
        )
    batches = calibration_batches(llm, text, SEQUENTIAL_WINDOWS)
    runner = _source_runner(llm)
    spec = RoundingSpec(damp=SEQUENTIAL_DAMP)
    layers = len(runner.model.layers)
    rounding = build_step("rounding weights (gptq-sequential)", layers, " layers")
    with torch.no_grad(), rounding as bar:
        return round_sequentially(
            runner.model, runner.ops, runner.backend, batches, spec, input_scales, kept,
            on_layer=lambda: bar.update(1),
        )  # fmt: skip


@dataclass
class SourcePass:
    """What the build measures and calibrates on the source before the engine is made (None:
    not asked for)."""

    source_ppl: dict[str, float] | Scores | None = None
    """The held-out perplexity, if checked (a pre-quantized checkpoint's: its Scores)."""
    scales: dict[str, float] | None = None  # static input scales ("fp8")
    kv_scales: list[tuple[float, float]] | None = None  # a float8 KV cache's
    kv_head_scales: KVHeadScales | None = None  # an int8 KV cache's, per KV head
    hessians: dict[str, torch.Tensor] | None = None  # GPTQ's input statistics ("gptq")
    smoothing: dict[str, torch.Tensor] | None = None  # SmoothQuant's factors
    rounded: dict | None = None  # "gptq-sequential"'s float8 weights; an INT4 build's codes
    outliers: dict[str, list[int]] | None = None  # --outlier-columns' channels


def run_source(
    path: str,
    options: BuildOptions,
    calibration: str | None,
    check: bool,
    kept: list[str],
    ppl_file: str | None = None,
    load_format: str = "auto",
) -> SourcePass:
    """What the options ask of the source, from one `LLM` of the unquantized source, freed
    before the quantized model is made. With smoothing, its model is smoothed before the other
    calibrations: their scales and statistics are of the smoothed inputs and weights the
    engine holds. The source's perplexity is read from `ppl_file` when an earlier build kept
    it there (the source is then not loaded at all unless something calibrates), else
    measured and kept there. `load_format`: "dequantized" for an FP4 source (its exact
    values, kiln.builder.fp4_source)."""
    from kiln.builder.accuracy import cached_perplexity, keep_perplexity, measure, measuring_llm
    from kiln.runtime.model_loader import is_float8_kv_cache, is_int8_kv_cache

    cached = cached_perplexity(ppl_file) if check else None
    found = SourcePass(source_ppl=cached)
    if calibration is None and (not check or cached is not None):
        if cached is not None:
            print(f"the source's held-out perplexity, measured before: {ppl_file}", flush=True)
        return found
    with measuring_llm(path, "source", dtype=options.dtype, max_model_len=options.max_model_len,
                       enable_prefix_caching=False, load_format=load_format) as llm:  # fmt: skip
        if check and cached is None:
            found.source_ppl = measure(llm, options.max_model_len, "source")
            keep_perplexity(ppl_file, found.source_ppl)
        if calibration is not None:
            if options.smoothing != "none":
                found.smoothing = smooth_source(
                    llm, path, calibration, options.smoothing, load_format
                )
            if options.quantization in INT4_BUILDS:
                found.rounded, found.smoothing = _round_int4(
                    llm, path, calibration, options, kept, load_format
                )
            wanted = (
                options.quantization == "fp8",
                is_float8_kv_cache(options.kv_cache_dtype),
                options.weight_rounding == "gptq",
            )
            if any(wanted) or options.outlier_columns:  # smoothing alone needs no second pass
                found.scales, found.kv_scales, found.hessians, amax = calibrate(
                    llm, calibration, *wanted, channel_amax=options.outlier_columns > 0
                )
                if amax is not None:
                    found.outliers = outlier_channels(amax, options.outlier_columns, kept)
            if options.weight_rounding == "gptq-sequential":  # needs the static scales
                found.rounded = round_weights(llm, calibration, found.scales, kept)
            if is_int8_kv_cache(options.kv_cache_dtype):
                found.kv_head_scales = measure_kv_head_scales(llm, calibration)
    return found


def measure_kv_head_scales(llm: LLM, text: str) -> KVHeadScales | None:
    """An int8 KV cache's per-(layer, KV head) scales over the calibration windows of `text`,
    measured on `llm`'s unquantized (smoothed, where it is) model."""
    from kiln.runtime.kv_calibration import head_scales, measure_kv_head_absmax

    if llm.get_tokenizer() is None:
        print("the source has no tokenizer: its int8 KV cache measures its scales at load")
        return None
    runner = _source_runner(llm)
    batches = calibration_batches(llm, text)
    with build_step("measuring int8 KV-cache scales", len(batches), " windows") as bar:
        absmax = measure_kv_head_absmax(runner.model, batches, runner.ops, runner.backend)
        bar.update(len(batches))
    return head_scales(absmax)


def _round_int4(
    llm: LLM, path: str, text: str, options: BuildOptions, kept: list[str], load_format: str
) -> tuple[dict, dict[str, torch.Tensor] | None]:
    """An INT4 build's codes (and AWQ's factors, with which the source is then reloaded, so a
    float8 or int8 KV cache calibrates on the smoothed model the engine is)."""
    from kiln.builder.calibrate.smoothing import smooth_checkpoint
    from kiln.builder.int4 import round_int4
    from kiln.runtime.model_loader import find_model_source

    rounded, factors = round_int4(llm, text, options.quantization, kept)
    if factors is not None and options.kv_cache_dtype != "auto":
        model = _source_runner(llm).model
        source = find_model_source(path, load_format)
        assert source.weights is not None, "a checkpoint, not dummy weights"
        with build_step("awq: reloading the source smoothed"):
            model.load_weights(smooth_checkpoint(source.weights, factors, model.config))
    return rounded, factors


def outlier_channels(
    amax: dict[str, torch.Tensor], count: int, kept: list[str]
) -> dict[str, list[int]]:
    """Each quantized projection's `count` loudest input channels (kept ones run unquantized)."""
    try:
        return choose_channels({n: a for n, a in amax.items() if n not in kept}, count)
    except ValueError as e:
        raise BuildError(f"--outlier-columns {count}: {e}") from None


def gptq_rounders(hessians: dict[str, torch.Tensor] | None) -> dict | None:
    """Each projection's GPTQ row rounder, from its input statistics ("gptq")."""
    if hessians is None:
        return None
    from kiln.builder.calibrate.gptq import GPTQRows

    return {name: GPTQRows(hessian) for name, hessian in hessians.items()}
