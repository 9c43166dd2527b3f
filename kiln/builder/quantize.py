"""A quantized build's two passes over the source: the unquantized source runs as an `LLM` (its
perplexity for the accuracy check, and for static "fp8" the activations that calibrate each
projection's input scale: kiln.builder.calibrate), then the weights load again into a model made
with the scheme's linear methods, which quantize each tensor as it arrives."""

from __future__ import annotations

import hashlib

from kiln.builder.progress import build_step
from kiln.errors import BuildError

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
    "calibrate",
    "calibration_batches",
    "round_weights",
    "smooth_source",
    "text_hash",
]


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def calibration_batches(
    llm: object, text: str, batches: int = _CALIBRATION_BATCHES
) -> list[list[int]]:
    """The calibration windows: the first `batches` windows of `text`'s tokens, sharing no
    prefix (the engine's prefix cache would skip repeated ones)."""
    ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    # A window and its one generated token must fit the model's context.
    n = min(_CALIBRATION_TOKENS, llm.engine.max_model_len - 1)
    return [ids[i : i + n] for i in range(0, len(ids), n)][:batches]


def smooth_source(llm: object, path: str, text: str, smoothing: str) -> dict:
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
    model = llm.engine.executor.runner.model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    batches = calibration_batches(llm, text)
    with build_step("smoothing: channel amax", len(batches), " windows") as bar:
        amax = calibrate_channel_amax(model, batches, lambda b: llm.generate(b, one_token))
        bar.update(len(batches))
    factors = smoothing_factors(model, amax, SmoothingSpec.parse(smoothing).alpha)
    source = find_model_source(path, "auto")
    with build_step("smoothing: reloading the source"):
        model.load_weights(smooth_checkpoint(source.weights, factors, model.config))
    return factors


def calibrate(
    llm: object,
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
    model = llm.engine.executor.runner.model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    wanted = (
        ("kv", calibrate_kv_scales, kv_scales),
        ("scales", calibrate_input_scales, input_scales),
        ("hessians", calibrate_hessians, hessians),
        ("channels", calibrate_channel_amax, channel_amax),
    )
    calibrators = [(key, calibrator) for key, calibrator, want in wanted if want]
    found: dict[str, object] = {}

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
    llm: object,
    text: str,
    input_scales: dict[str, float] | None,
    kept: list[str],
) -> dict[str, tuple]:
    """ "gptq-sequential"'s float8 weights, rounded layer after layer through `llm`'s unquantized
    model over SEQUENTIAL_WINDOWS calibration windows of `text` (the `kept` projections stay
    unquantized in it). `input_scales`: the static scales the engine's inputs quantize with,
    None per token."""
    import torch

    from kiln.builder.calibrate.sequential import RoundingSpec, round_sequentially

    batches = calibration_batches(llm, text, SEQUENTIAL_WINDOWS)
    runner = llm.engine.executor.runner
    spec = RoundingSpec(damp=SEQUENTIAL_DAMP)
    layers = len(runner.model.layers)
    rounding = build_step("rounding weights (gptq-sequential)", layers, " layers")
    with torch.no_grad(), rounding as bar:
        return round_sequentially(
            runner.model, runner.ops, runner.backend, batches, spec, input_scales, kept,
            on_layer=lambda: bar.update(1),
        )  # fmt: skip
