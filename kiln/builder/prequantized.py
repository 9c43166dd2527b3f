"""`kiln build` from a pre-quantized checkpoint: FP8 (llm-compressor's compressed-tensors, NVIDIA
ModelOpt's hf_quant_config.json; kiln.checkpoint.prequantized), INT4 W4A16 (GPTQ, AutoAWQ GEMM,
compressed-tensors pack-quantized; kiln.checkpoint.int4_formats) and 8-bit (block FP8, W8A8
INT8, W8A16 int8 / float8; kiln.checkpoint.eight_bit_formats).

The engine carries the checkpoint's quantization as it is, as the loader lays it out: float8
weights byte for byte (fused into qkv / gate_up as the loader fuses them), weight scales as the
loader lays them out (a per-tensor scale repeated over its rows), static input scales fused to
the largest of q/k/v (gate/up), k_scale / v_scale; INT4 codes, scales and zeros in kiln's layout
(an act-order checkpoint's inputs reordered as the loader reorders them, its g_idx kept, from
which the engine's loader takes the order); 8-bit codes unpacked, block and group scales as the
loader reads them. Nothing is re-quantized, so the engine must compute what
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

from kiln.checkpoint.eight_bit_formats import PrequantizedEightBit
from kiln.checkpoint.int4_formats import PrequantizedInt4
from kiln.checkpoint.prequantized import PrequantizedFp8, read_prequantized
from kiln.errors import BuildError

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
    "fp8": "FP8 checkpoint with static per-tensor input scales",
    "fp8-dynamic": "FP8 checkpoint with dynamic per-token activation scales",
    "fp8-block": "block FP8 checkpoint",
    "int8-w8a8": "W8A8 INT8 checkpoint",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
_PRODUCERS = {"compressed-tensors": "llm-compressor", "modelopt": "NVIDIA ModelOpt",
              "gptq": "AutoGPTQ / GPTQModel", "awq": "AutoAWQ",
              "fp8": "DeepSeek / Qwen FP8 release"}  # fmt: skip
# kiln build's names for INT4 rounding that also name a checkpoint rounded so (vLLM's
# --quantization gptq / awq for such checkpoints).
_PRODUCER_BUILDS = {"gptq": "int4-gptq", "awq": "int4-awq"}

Prequantized = PrequantizedFp8 | PrequantizedInt4 | PrequantizedEightBit


def inspect(path: str) -> Prequantized | None:
    """The scheme a pre-quantized HF checkpoint directory declares (read in the loader's order),
    None for an unquantized one or a GGUF file (what cannot be read is the loader's one-line
    error)."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from kiln.checkpoint.eight_bit_formats import read_eight_bit
    from kiln.checkpoint.int4_formats import read_int4
    from kiln.checkpoint.safetensors_loader import read_hf_config

    config = read_hf_config(path)
    eight_bit = read_eight_bit(path, config)
    return eight_bit or read_int4(path, config) or read_prequantized(path, config)


def describe(scheme: Prequantized) -> str:
    """The checkpoint in words: "a gptq INT4 (W4A16) checkpoint (int4-g128)"."""
    if isinstance(scheme, PrequantizedInt4):
        what = "INT4 (W4A16) checkpoint"
    else:
        what = _SCHEMES.get(scheme.quantization, "weight-only 8-bit (W8A16) checkpoint")
    producer = "DeepSeek / Qwen-format" if scheme.producer == "fp8" else scheme.producer
    return f"a {producer} {what} ({scheme.quantization})"


def input_scales(scheme: Prequantized) -> dict[str, float] | None:
    """The checkpoint's static input scales (FP8's "fp8" only)."""
    return scheme.input_scales if isinstance(scheme, PrequantizedFp8) else None


def kv_scales(scheme: Prequantized) -> list[tuple[float, float]] | None:
    """The checkpoint's float8 KV cache scales (the FP8 formats' only: kiln's INT4 and 8-bit
    readers take none)."""
    return scheme.kv_scales if isinstance(scheme, PrequantizedFp8) else None


def resolve_quantization(requested: str, scheme: Prequantized | None, path: str) -> str:
    """The scheme a build makes: "auto" is the checkpoint's (none for an unquantized one); the
    checkpoint's own name, or int4-gptq / int4-awq for a GPTQ / AWQ one, names it too."""
    from kiln.builder.options import QUANTIZATIONS

    if scheme is None:
        if requested not in QUANTIZATIONS:  # a checkpoint's own scheme (CHECKPOINT_SCHEMES)
            raise BuildError(
                f"--quantization {requested} names a pre-quantized checkpoint's scheme; {path} "
                f"holds no such weights (kiln builds INT4 from an unquantized checkpoint with "
                "int4-gptq or int4-awq)"
            )
        return "none" if requested == "auto" else requested
    own = scheme.quantization
    if requested in ("auto", own, _PRODUCER_BUILDS.get(scheme.producer)):
        return own
    what = f"{path} is {describe(scheme)}"
    if requested == "none":
        raise BuildError(
            f"{what}: kiln build carries its weights as they are and does not dequantize them; "
            f"leave --quantization out (or pass {own}), or build from the unquantized checkpoint"
        )
    raise BuildError(
        f"{what}; --quantization {requested} would re-quantize it: leave --quantization out "
        f"(or pass {own}), or build {requested} from the unquantized checkpoint"
    )


def check_tensor_parallel(path: str, scheme: Prequantized, tp: int) -> None:
    """-tp N cuts the weights as loading the checkpoint under TP cuts them: INT4 act-order
    (GPTQ's desc_act, compressed-tensors' actorder "group") does not cut by input columns."""
    if tp == 1 or not isinstance(scheme, PrequantizedInt4):
        return
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        declared = json.load(f).get("quantization_config") or {}
    groups = (declared.get("config_groups") or {}).values()
    act_order = declared.get("desc_act") or any(
        (g.get("weights") or {}).get("actorder") == "group" for g in groups
    )
    if act_order:
        raise BuildError(
            f"{path} is {describe(scheme)} with act-order (desc_act) inputs: a row-parallel "
            f"rank's inputs would not hold whole groups, so -tp {tp} cannot cut it (loading it "
            "under tensor parallelism is refused too); build it without -tp"
        )


def kv_calibration(
    path: str,
    scheme: Prequantized,
    options: BuildOptions,
    read_text: Callable[[BuildOptions], str | None],
) -> str | None:
    """The text a float8 KV cache's scales are calibrated on, when the build needs them: the
    cache is float8 and the checkpoint has no k/v scales of its own. Calibration tokenizes text:
    a checkpoint without a tokenizer keeps an unscaled float8 cache, as loading it does. An int8
    cache measures its per-head scales at load, as loading the checkpoint directly does."""
    from kiln.runtime.model_loader import is_float8_kv_cache

    if kv_scales(scheme) is not None or not is_float8_kv_cache(options.kv_cache_dtype):
        return None
    text = read_text(replace(options, quantization="none"))  # a float8 cache's text, or None
    if text is not None and not any(
        os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES
    ):
        print("the checkpoint has no tokenizer: its float8 KV cache stays unscaled", flush=True)
        return None
    return text


def scales_method(scheme: Prequantized) -> str:
    q = scheme.quantization
    if isinstance(scheme, PrequantizedInt4):
        weights = "INT4 codes, scales and zero points as written (in kiln's layout)"
        inputs = "activations in the model dtype"
    elif q == "int8-w8a8":
        weights, inputs = "int8 weights, weight scales as written", "dynamic per-token int8"
    elif q == "fp8-block":
        weights = "float8 weights, 128x128 block scales as written"
        inputs = "dynamic activation scales per group of 128 inputs"
    elif "-w8a16-" in q:
        weights, inputs = "8-bit weights, scales as written", "activations in the model dtype"
    elif q == "fp8":
        weights = "float8 weights, weight scales as written"
        inputs = "static per-tensor input scales (q/k/v and gate/up fused to their largest)"
    else:
        weights = "float8 weights, weight scales as written"
        inputs = "dynamic per-token activation scales"
    return f"the {scheme.producer} checkpoint's: {weights}; {inputs}"


def quantization_source(path: str, scheme: Prequantized, kv_origin: str | None) -> dict:
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
    kind = "INT4" if isinstance(scheme, PrequantizedInt4) else "8-bit"
    kind = "float8" if isinstance(scheme, PrequantizedFp8) else kind
    return {
        "method": f"pre-quantized checkpoint: its {kind} weights and scales carried as written "
        "(no re-quantization)",
        "format": scheme.producer,
        "producer": _PRODUCERS.get(scheme.producer, scheme.producer),
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
