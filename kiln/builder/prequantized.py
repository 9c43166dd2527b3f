"""`kiln build` from a pre-quantized FP8 checkpoint (llm-compressor's compressed-tensors, NVIDIA
ModelOpt's hf_quant_config.json; read by kiln.checkpoint.prequantized).

The engine carries the checkpoint's quantization as it is: its float8 weights byte for byte
(fused into qkv / gate_up as the loader fuses them), its weight scales as the loader lays them
out (a per-tensor scale repeated over its rows), its static input scales fused to the largest of
q/k/v (gate/up), its k_scale / v_scale. Nothing is re-quantized, so the engine must compute what
kiln computes loading the checkpoint directly: the accuracy check compares the two (equal within
float noise) and reports the perplexity of both, whose baseline is the quantized checkpoint, not
an unquantized model (none is at hand).

What `--quantization` means here, as vLLM's and TensorRT-LLM's users expect: left out ("auto"),
the checkpoint's own scheme; the same scheme named explicitly, the same; anything else would mean
re-quantizing or dequantizing the checkpoint's weights, which a build refuses in one line (vLLM
refuses a `--quantization` that contradicts the checkpoint's config the same way; TensorRT-LLM
refuses to quantize a checkpoint that is quantized already).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kiln.checkpoint.prequantized import PrequantizedFp8, read_prequantized
from kiln.errors import BuildError, ModelLoadError

if TYPE_CHECKING:  # build.py imports this module
    from kiln.builder.options import BuildOptions

# The engine's and the checkpoint's perplexities may differ by float noise only (the same
# weights and the same kernels: on the CPU they are equal to the bit; a reordered sum on a GPU
# moves a perplexity by far less than this).
SAME_ARITHMETIC_PCT = 0.01
# Without a tokenizer the held-out text's UTF-8 bytes (mod the vocabulary) are the tokens: as
# many as the check scores of a real tokenizer's text, roughly.
_MAX_BYTE_TOKENS = 4096
_SCHEMES = {
    "fp8": "static per-tensor input scales",
    "fp8-dynamic": "dynamic per-token activation scales",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_PRODUCERS = {"compressed-tensors": "llm-compressor", "modelopt": "NVIDIA ModelOpt"}


def inspect(path: str) -> PrequantizedFp8 | None:
    """The FP8 scheme an HF checkpoint directory declares, None for an unquantized one or a GGUF
    file (what cannot be read is the loader's one-line error)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from kiln.checkpoint.eight_bit_formats import read_eight_bit
    from kiln.checkpoint.int4_formats import read_int4
    from kiln.checkpoint.safetensors_loader import read_hf_config

    config = read_hf_config(path)
    eight_bit = read_eight_bit(path, config)
    if eight_bit is not None:
        raise ModelLoadError(
            f"{path}: kiln build does not take {eight_bit.quantization} ({eight_bit.producer}) "
            'checkpoints yet; they load directly (LLM("./checkpoint"), kiln serve ./checkpoint)'
        )
    int4 = read_int4(path, config)
    if int4 is not None:
        raise ModelLoadError(
            f"{path}: kiln build does not take INT4 ({int4.producer}) checkpoints yet; they load "
            'directly (LLM("./checkpoint"), kiln serve ./checkpoint)'
        )
    return read_prequantized(path, config)


def resolve_quantization(requested: str, fp8: PrequantizedFp8 | None, path: str) -> str:
    """The scheme a build makes: "auto" is the checkpoint's (none for an unquantized one)."""
    if fp8 is None:
        return "none" if requested == "auto" else requested
    if requested in ("auto", fp8.quantization):
        return fp8.quantization
    what = f"{path} is a {fp8.producer} FP8 checkpoint with {_SCHEMES[fp8.quantization]}"
    if requested == "none":
        raise BuildError(
            f"{what}: kiln build carries its float8 weights as they are and does not dequantize "
            f"them; leave --quantization out (or pass {fp8.quantization}), or build from the "
            "unquantized checkpoint"
        )
    raise BuildError(
        f"{what} (quantization {fp8.quantization}); --quantization {requested} would "
        f"re-quantize it: leave --quantization out (or pass {fp8.quantization}), or build "
        f"{requested} from the unquantized checkpoint"
    )


def kv_calibration(
    path: str,
    fp8: PrequantizedFp8,
    options: BuildOptions,
    read_text: Callable[[BuildOptions], str | None],
) -> str | None:
    """The text a float8 KV cache's scales are calibrated on, when the build needs them: the
    cache is float8 and the checkpoint has no k/v scales of its own. Calibration tokenizes text:
    a checkpoint without a tokenizer keeps an unscaled float8 cache, as loading it does."""
    if fp8.kv_scales is not None:
        return None
    text = read_text(replace(options, quantization="none"))  # a float8 cache's text, or None
    if text is not None and not any(
        os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES
    ):
        print("the checkpoint has no tokenizer: its float8 KV cache stays unscaled", flush=True)
        return None
    return text


def scales_method(fp8: PrequantizedFp8) -> str:
    if fp8.quantization == "fp8":
        inputs = "static per-tensor input scales (q/k/v and gate/up fused to their largest)"
    else:
        inputs = "dynamic per-token activation scales"
    return f"the {fp8.producer} checkpoint's: float8 weights, weight scales as written; {inputs}"


def quantization_source(path: str, fp8: PrequantizedFp8, kv_origin: str | None) -> dict:
    """The manifest's record of where the quantization came from: the method, the checkpoint's
    format and the quantization config it declares (as written), and where the KV scales are
    from."""
    modelopt_file = os.path.join(path, "hf_quant_config.json")
    if os.path.isfile(modelopt_file):
        config_file = "hf_quant_config.json"
        with open(modelopt_file, encoding="utf-8") as f:
            config = json.load(f)
    else:
        config_file = "config.json"
        with open(os.path.join(path, config_file), encoding="utf-8") as f:
            config = json.load(f).get("quantization_config")
    return {
        "method": "pre-quantized checkpoint: its float8 weights and scales carried as written "
        "(no re-quantization)",
        "format": fp8.producer,
        "producer": _PRODUCERS.get(fp8.producer, fp8.producer),
        "config_file": config_file,
        "config": config,
        "kv_scales": kv_origin,
    }


@dataclass(frozen=True)
class Scores:
    """Per-token log-probabilities of the held-out tokens and the perplexities they make."""

    token_logprobs: list[float]
    word_perplexity: float | None  # None without a tokenizer (no words to count)
    token_perplexity: float
    held_out: str


def score(llm: Any, max_length: int | None, label: str) -> Scores:
    """`llm`'s log-probability of every held-out token, in rolling windows as kiln eval's
    perplexity (lm-eval's definition) scores them (`label`: the checkpoint, the engine)."""
    from kiln.builder.accuracy import _HELD_OUT_ARTICLES, HELD_OUT_FILE, wikitext_articles
    from kiln.builder.progress import build_step, counting
    from kiln.eval.perplexity import count_words, prefix_token_id, scored_windows

    documents = wikitext_articles(HELD_OUT_FILE, _HELD_OUT_ARTICLES)
    held_out = f"wikitext-2 valid.txt, first {_HELD_OUT_ARTICLES} articles"
    tokenizer = llm.get_tokenizer()
    if tokenizer is not None:
        token_docs = [tokenizer.encode(d, add_special_tokens=False) for d in documents]
    else:
        vocab = llm.engine.model_config.vocab_size
        token_docs = [[b % vocab for b in d.encode()[:_MAX_BYTE_TOKENS]] for d in documents]
        held_out += f" (no tokenizer: its first {_MAX_BYTE_TOKENS} UTF-8 bytes mod the vocabulary)"
    logprobs: list[float] = []
    with build_step(f"held-out log-probabilities of the {label}", unit=" tokens") as bar:
        windows = scored_windows(llm, token_docs, prefix_token_id(llm), max_length, counting(bar))
        for _, window_logprobs in windows:
            logprobs += window_logprobs
    total = math.fsum(logprobs)
    words = sum(count_words(d) for d in documents) if tokenizer is not None else None
    return Scores(
        logprobs,
        math.exp(-total / words) if words else None,
        math.exp(-total / len(logprobs)),
        held_out,
    )


def run_source(
    path: str, options: BuildOptions, calibration: str | None, check: bool
) -> tuple[Scores | None, list[tuple[float, float]] | None]:
    """(the checkpoint's scores as kiln loads it directly, KV cache scales calibrated on
    `calibration` when the build needs them and the checkpoint has none), from one `LLM` of the
    checkpoint, freed before the engine's model is made. The baseline runs with the engine's KV
    cache dtype, unless the build calibrates new KV scales: then with the model dtype's cache,
    the arithmetic the new scales are checked against."""
    if not check and calibration is None:
        return None, None
    from kiln.builder.accuracy import measuring_llm
    from kiln.builder.quantize import calibrate

    kv_scales = None
    with measuring_llm(
        path,
        "checkpoint",
        dtype=options.dtype,
        max_model_len=options.max_model_len,
        kv_cache_dtype="auto" if calibration is not None else options.kv_cache_dtype,
        lm_head_quantization=options.lm_head_quantization,
        enable_prefix_caching=False,
    ) as llm:
        scores = score(llm, options.max_model_len, "checkpoint") if check else None
        if calibration is not None:
            _, kv_scales, _, _ = calibrate(llm, calibration, False, True)
    return scores, kv_scales


def accuracy(
    engine: str, options: BuildOptions, baseline: Scores | None, same_arithmetic: bool
) -> dict[str, Any]:
    """The engine's scores against the checkpoint's: equal within float noise when the build
    added nothing (`same_arithmetic`), else (new KV scales) within --max-ppl-increase."""
    if baseline is None:
        return {"checked": False, "reason": "--no-accuracy-check"}
    from kiln.builder.accuracy import measuring_llm

    with measuring_llm(
        engine,
        "engine",
        kv_cache_dtype=options.kv_cache_dtype,
        max_model_len=options.max_model_len,
        tensor_parallel_size=options.tensor_parallel_size,
        enable_prefix_caching=False,
    ) as llm:
        got = score(llm, options.max_model_len, "engine")
    metric = "word_perplexity" if baseline.word_perplexity is not None else "token_perplexity"
    source_ppl, engine_ppl = getattr(baseline, metric), getattr(got, metric)
    increase = 100.0 * (engine_ppl / source_ppl - 1.0)
    # The checkpoint's producer quantized it: 1% against it unless told otherwise.
    asked = 1.0 if options.max_ppl_increase is None else options.max_ppl_increase
    limit = SAME_ARITHMETIC_PCT if same_arithmetic else asked
    passed = abs(increase) <= limit if same_arithmetic else increase <= limit
    diff = max((abs(a - b) for a, b in zip(baseline.token_logprobs, got.token_logprobs)),
               default=0.0)  # fmt: skip
    return {
        "checked": True,
        "baseline": (
            "the pre-quantized checkpoint as kiln loads it directly (with the engine's KV cache "
            "dtype): the engine must compute what it computes, within float noise"
            if same_arithmetic
            else "the pre-quantized checkpoint as kiln loads it directly, with a model-dtype KV "
            "cache: the build added calibrated float8 KV scales"
        ),
        "baseline_is_quantized": True,
        "held_out": baseline.held_out,
        "tokens": len(got.token_logprobs),
        "metric": metric,
        "source_word_perplexity": baseline.word_perplexity,
        "engine_word_perplexity": got.word_perplexity,
        "source_token_perplexity": baseline.token_perplexity,
        "engine_token_perplexity": got.token_perplexity,
        "perplexity_increase_pct": increase,
        "max_abs_token_logprob_diff": diff,
        "max_ppl_increase_pct": limit,
        "passed": passed,
    }


def failure(report: dict[str, Any]) -> str:
    m = report["metric"].replace("_", " ")
    return (
        f"the engine's {m} {report['engine_' + report['metric']]:.6f} differs by "
        f"{report['perplexity_increase_pct']:+.4f}% from the checkpoint's "
        f"{report['source_' + report['metric']]:.6f} loaded directly (limit "
        f"{report['max_ppl_increase_pct']}%; --no-accuracy-check builds it anyway)"
    )
