"""A quantized build's two passes over the source: the unquantized source runs as an `LLM` (its
perplexity for the accuracy check, and for static "fp8" the activations that calibrate each
projection's input scale), then the weights load again into a model made with the scheme's
linear methods, which quantize each tensor as it arrives."""

from __future__ import annotations

import hashlib

from kiln.errors import BuildError
from kiln.quantization import linear_method_factory

_CALIBRATION_TOKENS = 512
_CALIBRATION_BATCHES = 8
SCALES_METHOD = {
    "fp8": "static per-tensor input scales calibrated at build time; per-channel weights",
    "fp8-dynamic": "dynamic per-token input scales; per-channel weights",
}

__all__ = ["SCALES_METHOD", "calibrate", "linear_method_factory", "text_hash"]


def text_hash(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=32).hexdigest()


def calibrate(
    llm: object, text: str, input_scales: bool, kv_scales: bool
) -> tuple[dict[str, float] | None, list[tuple[float, float]] | None]:
    """(static input scales, layer name -> absmax / 448, if `input_scales`; per-layer float8 KV
    cache scales if `kv_scales`) from `llm`'s unquantized model run over the first tokens of
    `text`, in windows that share no prefix (the engine's prefix cache would skip repeated
    ones)."""
    from kiln.quantization.calibration import calibrate_input_scales
    from kiln.quantization.kv_scales import calibrate_kv_scales
    from kiln.sampling_params import SamplingParams

    tokenizer = llm.get_tokenizer()
    if tokenizer is None:  # calibration text needs the model's tokenizer
        if input_scales:
            raise BuildError('quantization "fp8" calibrates on text: the source has no tokenizer')
        print("the source has no tokenizer: its float8 KV cache stays unscaled", flush=True)
        return None, None
    ids = tokenizer.encode(text, add_special_tokens=False)
    # A window and its one generated token must fit the model's context.
    n = min(_CALIBRATION_TOKENS, llm.engine.max_model_len - 1)
    batches = [ids[i : i + n] for i in range(0, len(ids), n)][:_CALIBRATION_BATCHES]
    model = llm.engine.executor.runner.model
    one_token = SamplingParams(max_tokens=1, temperature=0.0)

    def run(b: list[list[int]]) -> object:
        return llm.generate(b, one_token)

    if not kv_scales:
        return calibrate_input_scales(model, batches, run), None
    if not input_scales:
        return None, calibrate_kv_scales(model, batches, run)
    # Both from one pass: the input observers wrap the KV observers, which wrap the methods.
    inputs: dict[str, float] = {}
    kv = calibrate_kv_scales(
        model, batches, lambda b: inputs.update(calibrate_input_scales(model, b, run))
    )
    return inputs, kv
