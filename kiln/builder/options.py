"""`kiln build`'s options (BuildOptions), checked once, and what they decide before anything
loads: the calibration text, the layers kept unquantized, the words for the engine's scales."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass

from kiln.builder.calibrate.smoothing import SmoothingSpec
from kiln.builder.quantize import SCALES_METHOD, WEIGHT_ROUNDINGS
from kiln.errors import BuildError
from kiln.layers.quantization.outlier_columns import COLUMN_MULTIPLE
from kiln.models.config import ModelConfig

QUANTIZATIONS = ("auto", "none", "fp8", "fp8-dynamic", "int8-w8a8", "fp8-block",
                 "int8-w8a16-channel", "int8-w8a16-g128", "int8-w8a16-g16", "fp8-w8a16-channel",
                 "int4-gptq", "int4-awq")  # fmt: skip
# What a pre-quantized INT4 / 8-bit checkpoint's own scheme may be called besides QUANTIZATIONS
# (kiln.checkpoint.int4_formats, eight_bit_formats): "auto" resolves to it, naming it is the same.
CHECKPOINT_SCHEMES = re.compile(r"int4-(g\d+|channel)(-sym)?|(int8|fp8)-w8a16-(g\d+|channel)")
KV_CACHE_DTYPES = ("auto", "fp8", "int8")
DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class BuildOptions:
    quantization: str = "auto"
    """"none", "fp8" (static input scales calibrated at build time), "fp8-dynamic", "int8-w8a8"
    (int8 weights per channel, activations per token; with --smoothing, SmoothQuant), "fp8-block"
    (float8 weights per 128x128 block, activations per group of 128 inputs), weight-only
    "int8-w8a16-channel", "int8-w8a16-g128", "int8-w8a16-g16" (an FP4 checkpoint's exact
    values) or "fp8-w8a16-channel", "int4-gptq" or "int4-awq"
    (W4A16, groups of 128 with zero points, rounded by GPTQ layer after layer or by AWQ's scale
    search on the calibration text: kiln.builder.int4), or "auto": a pre-quantized checkpoint's
    own scheme (kiln.builder.prequantized), else "none". A pre-quantized INT4 / 8-bit
    checkpoint's scheme may be named too ("int4-g128", "int8-w8a16-g64": CHECKPOINT_SCHEMES)."""
    kv_cache_dtype: str = "auto"
    """"auto" (the model dtype) or "fp8"."""
    dtype: str = "auto"
    """Unquantized weights' dtype: "auto" (float32 on the CPU, bfloat16 on CUDA) or a name."""
    max_model_len: int | None = None
    """Longest prompt + output the memory plan and the accuracy check assume (None: the model's)."""
    calibration_data: str | None = None
    """Text file for static scales (None: the head of WikiText-2's test split)."""
    max_ppl_increase: float | None = None
    """Most word-perplexity increase (percent) over the source a quantized engine may have.
    None: by the model's size (kiln.builder.accuracy.ppl_limit: 1% from 1B parameters, 5%
    below; INT4 builds 5% and 25%)."""
    accuracy_check: bool = True
    """Measure source and engine perplexity on held-out text (quantized builds only)."""
    tensor_parallel_size: int = 1
    """> 1: write one weight shard per tensor rank (rank-R/), so each rank of an engine run with
    that tensor_parallel_size reads only its part; such an engine loads at that size only."""
    warm_kernels: bool = True
    """On a GPU: run the engine once and carry the Triton kernels it compiled (kiln.builder.warm),
    so its first process does not compile them. Not part of the engine id: an optimisation."""
    lm_head_quantization: str = "none"
    """"fp8": the LM head in float8 with per-row scales (cut by vocabulary rows under -tp N);
    "none"."""
    weight_rounding: str = "nearest"
    """How float8 weights round: "nearest", or "gptq" (kiln.builder.calibrate.gptq: each
    projection's rounding error spread over its other weights by its inputs' statistics on the
    calibration text; the same format, scales and kernels, a slower build); "gptq-sequential":
    layer after layer, each from the inputs of a model whose earlier layers are float8 already
    (kiln.builder.calibrate.sequential). Every rounding runs on the whole model in the build's
    one process; -tp N then cuts the rounded weights per rank (write_rank_shards)."""
    unquantized_layers: tuple[str, ...] = ()
    """Decoder projections kept in the model dtype in a quantized build, as fnmatch patterns
    over kiln's layer names ("layers.*.mlp.gate_up_proj", "layers.29.*"); each must match one.
    Like llm-compressor's and ModelOpt's ignore lists: accuracy bought with those layers'
    speed and bytes. The manifest lists the layers matched."""
    smoothing: str = "none"
    """"none", or "smoothquant[:alpha]" (kiln.builder.calibrate.smoothing: each FP8
    projection's input channels divided by factors calibrated on the calibration text, the
    weights' columns multiplied by them, folded into the ops before; the same format and
    kernels). Stored as "smoothquant:<alpha>", the default alpha filled in (0.7 for
    fp8-dynamic, 0.3 for fp8)."""

    outlier_columns: int = 0
    """> 0: each FP8 projection's that many loudest input channels on the calibration text
    (a multiple of 16) carried as a second float8 term (kiln.layers.quantization.outlier_columns):
    accuracy near per-token scales' for static "fp8", at K + n GEMM columns and unfused
    quantization. 0: off."""

    lora: str | None = None
    """A PEFT LoRA adapter directory merged into the weights before anything else
    (kiln.builder.lora_merge): the engine is the fine-tuned model, its accuracy checked against
    the merged model. Its bytes, not its path, name the engine."""

    def __post_init__(self) -> None:
        for name, allowed in (
            ("quantization", QUANTIZATIONS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("dtype", DTYPES),
            ("lm_head_quantization", ("none", "fp8")),
            ("weight_rounding", WEIGHT_ROUNDINGS),
        ):
            if name == "quantization" and CHECKPOINT_SCHEMES.fullmatch(self.quantization):
                continue
            if getattr(self, name) not in allowed:
                raise BuildError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        try:
            spec = SmoothingSpec.parse(self.smoothing, self.quantization)
        except ValueError as e:
            raise BuildError(str(e)) from None
        object.__setattr__(self, "smoothing", str(spec))  # canonical: names the engine
        object.__setattr__(self, "unquantized_layers", tuple(self.unquantized_layers))
        if self.max_ppl_increase is not None and not 0 <= self.max_ppl_increase < float("inf"):
            raise BuildError(
                f"max_ppl_increase must be a percentage >= 0, got {self.max_ppl_increase!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise BuildError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise BuildError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.outlier_columns < 0 or self.outlier_columns % COLUMN_MULTIPLE:
            raise BuildError(
                f"outlier_columns must be a multiple of {COLUMN_MULTIPLE}, got "
                f"{self.outlier_columns}"
            )
        self._check_quantized_options()

    def _check_quantized_options(self) -> None:
        """The options that change float8 weights need a float8 build (INT8 takes smoothing and
        unquantized layers; GPTQ's and outlier columns' float8 codes it cannot)."""
        if self.quantization in ("int4-gptq", "int4-awq"):
            for name, default in (("smoothing", "none"), ("weight_rounding", "nearest"),
                                  ("outlier_columns", 0), ("tensor_parallel_size", 1)):  # fmt: skip
                if getattr(self, name) != default:
                    raise BuildError(
                        f"{name} {getattr(self, name)!r} is not supported with quantization "
                        f"{self.quantization!r} (its rounding is the scheme's own; an INT4 "
                        "engine is built whole and cut as it loads under -tp N)"
                    )
            return
        if self.quantization.startswith(("int8-", "fp8-block", "fp8-w8a16")) and (
            self.weight_rounding != "nearest" or self.outlier_columns
        ):
            raise BuildError(
                "weight_rounding and outlier_columns make float8 weights: they need "
                f"--quantization fp8 or fp8-dynamic ({self.quantization} rounds to nearest)"
            )
        if "-w8a16-" in self.quantization and self.smoothing != "none":
            raise BuildError(
                f"smoothing moves activations' outliers into the weights: {self.quantization} "
                "quantizes no activations (build it without --smoothing)"
            )
        if self.quantization != "none":
            return
        if self.smoothing != "none":
            raise BuildError(
                f'smoothing "{self.smoothing}" moves FP8 activations\' range into the weights: it '
                "needs --quantization fp8 or fp8-dynamic"
            )
        if self.unquantized_layers:
            raise BuildError("unquantized_layers keeps layers of a quantized build: it needs "
                             "--quantization fp8 or fp8-dynamic")  # fmt: skip
        if self.weight_rounding != "nearest":
            raise BuildError(
                f'weight_rounding "{self.weight_rounding}" rounds float8 weights: it needs '
                "--quantization fp8 or fp8-dynamic"
            )
        if self.outlier_columns:
            raise BuildError("outlier columns are float8 inputs' second term: they need "
                             "--quantization fp8 or fp8-dynamic")  # fmt: skip


def unquantized_layer_names(cfg: ModelConfig, patterns: tuple[str, ...]) -> list[str]:
    """The decoder projections `patterns` name, in layer order; a pattern matching none is an
    error (a typo would otherwise quantize what it meant to keep)."""
    names = [
        f"layers.{i}.{kind}"
        for i in range(cfg.num_hidden_layers)
        for kind in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    ]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise BuildError(
                f"--unquantized-layers {pattern!r} matches no projection (names are like "
                f"{names[2]!r}; patterns as fnmatch: 'layers.*.mlp.gate_up_proj')"
            )
    return [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def scales_method(options: BuildOptions) -> str | None:
    """How the engine's scales were made, in words, for its manifest."""
    method = SCALES_METHOD.get(options.quantization)
    if method and options.smoothing != "none":
        alpha = options.smoothing.partition(":")[2]
        method += (
            f"; inputs smoothed per channel (SmoothQuant, alpha {alpha}) on the calibration text, "
            "folded into the norms, up_proj and v_proj"
        )
    if method and options.weight_rounding != "nearest":
        method += "; weights rounded by GPTQ on the calibration text's input statistics"
        if options.weight_rounding == "gptq-sequential":
            method += ", layer after layer"
    if method and options.outlier_columns:
        method += (
            f"; each projection's {options.outlier_columns} loudest input channels on the "
            "calibration text carried as a second float8 term (outlier columns)"
        )
    return method


def calibration_text(options: BuildOptions) -> str | None:
    """The text scales are calibrated on: "fp8"'s static input scales, a float8 KV cache's
    per-layer scales, an int8 one's per-head scales, GPTQ's input statistics, smoothing's
    factors and the INT4 builds' rounding calibrate; nothing else does."""
    calibrates = (
        options.quantization in ("fp8", "int4-gptq", "int4-awq")
        or options.weight_rounding != "nearest"
        or options.smoothing != "none"
        or options.outlier_columns > 0
    )
    if not calibrates and options.kv_cache_dtype == "auto":
        return None
    from kiln.builder.accuracy import CALIBRATION_FILE

    file = options.calibration_data or CALIBRATION_FILE
    try:
        with open(file, encoding="utf-8") as f:
            return f.read() if options.calibration_data else f.read(200_000)
    except OSError as e:
        raise BuildError(f"calibration data {file} cannot be read: {e}") from e


def changes_arithmetic(options: BuildOptions) -> bool:
    """Whether the engine computes otherwise than its source (what the accuracy check is for)."""
    return (
        options.quantization != "none"
        or options.kv_cache_dtype != "auto"
        or options.lm_head_quantization != "none"
    )
