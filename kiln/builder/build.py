"""build_engine: source -> engine directory. Hash the source, return a cached engine if these
inputs were built before, print the memory plan, load (and quantize), write fused weights,
tokenizer and configs, check accuracy, write the manifest, move the directory into place."""

from __future__ import annotations

import fnmatch
import gc
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace

import torch
from tqdm.auto import tqdm

import kiln
from kiln.builder import cache, prequantized
from kiln.builder.calibrate.smoothing import SmoothingSpec, smooth_checkpoint
from kiln.builder.manifest import EngineManifest
from kiln.builder.plan import plan_memory
from kiln.builder.quantize import (
    SCALES_METHOD,
    SEQUENTIAL_DAMP,
    SEQUENTIAL_WINDOWS,
    WEIGHT_ROUNDINGS,
    calibrate,
    round_weights,
    smooth_source,
    text_hash,
)
from kiln.builder.tiles import kernel_tiles
from kiln.builder.weights import write_rank_shards, write_weights
from kiln.checkpoint.engine_dir import current_gpu_class, is_engine_dir
from kiln.checkpoint.file_hash import hash_files
from kiln.errors import BuildError
from kiln.layers.quantization import linear_method_factory
from kiln.layers.quantization.device import check_float8_device
from kiln.layers.quantization.fp8 import Fp8LinearMethod
from kiln.layers.quantization.outlier_columns import COLUMN_MULTIPLE, choose_channels
from kiln.models import registry
from kiln.models.config import ModelConfig
from kiln.models.kv_scales import fold_kv_scales
from kiln.runtime.model_loader import (
    find_model_source,
    is_float8_kv_cache,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)

QUANTIZATIONS = ("auto", "none", "fp8", "fp8-dynamic")
KV_CACHE_DTYPES = ("auto", "fp8")
DTYPES = ("auto", "float32", "float16", "bfloat16")
# Copied verbatim from an HF source directory (the tokenizer, its chat template, sampling
# defaults); a GGUF source's tokenizer is saved by transformers instead.
_HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class BuildOptions:
    quantization: str = "auto"
    """"none", "fp8" (static input scales calibrated at build time), "fp8-dynamic", or "auto": a
    pre-quantized checkpoint's own scheme (kiln.builder.prequantized), else "none"."""
    kv_cache_dtype: str = "auto"
    """"auto" (the model dtype) or "fp8"."""
    dtype: str = "auto"
    """Unquantized weights' dtype: "auto" (float32 on the CPU, bfloat16 on CUDA) or a name."""
    max_model_len: int | None = None
    """Longest prompt + output the memory plan and the accuracy check assume (None: the model's)."""
    calibration_data: str | None = None
    """Text file for static scales (None: the head of WikiText-2's test split)."""
    max_ppl_increase: float = 1.0
    """Most word-perplexity increase (percent) over the source a quantized engine may have."""
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

    def __post_init__(self) -> None:
        for name, allowed in (
            ("quantization", QUANTIZATIONS),
            ("kv_cache_dtype", KV_CACHE_DTYPES),
            ("dtype", DTYPES),
            ("lm_head_quantization", ("none", "fp8")),
            ("weight_rounding", WEIGHT_ROUNDINGS),
        ):
            if getattr(self, name) not in allowed:
                raise BuildError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        try:
            spec = SmoothingSpec.parse(self.smoothing, self.quantization)
        except ValueError as e:
            raise BuildError(str(e)) from None
        object.__setattr__(self, "smoothing", str(spec))  # canonical: names the engine
        if spec.method != "none" and self.quantization == "none":
            raise BuildError(
                f'smoothing "{self.smoothing}" moves FP8 activations\' range into the weights: it '
                "needs --quantization fp8 or fp8-dynamic"
            )
        object.__setattr__(self, "unquantized_layers", tuple(self.unquantized_layers))
        if self.unquantized_layers and self.quantization == "none":
            raise BuildError("unquantized_layers keeps layers of a quantized build: it needs "
                             "--quantization fp8 or fp8-dynamic")  # fmt: skip
        if not 0 <= self.max_ppl_increase < float("inf"):
            raise BuildError(
                f"max_ppl_increase must be a percentage >= 0, got {self.max_ppl_increase!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 1:
            raise BuildError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.tensor_parallel_size < 1:
            raise BuildError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.weight_rounding != "nearest" and self.quantization == "none":
            raise BuildError(
                f'weight_rounding "{self.weight_rounding}" rounds float8 weights: it needs '
                "--quantization fp8 or fp8-dynamic"
            )
        if self.outlier_columns:
            if self.outlier_columns < 0 or self.outlier_columns % COLUMN_MULTIPLE:
                raise BuildError(
                    f"outlier_columns must be a multiple of {COLUMN_MULTIPLE}, got "
                    f"{self.outlier_columns}"
                )
            if self.quantization == "none":
                raise BuildError("outlier columns are float8 inputs' second term: they need "
                                 "--quantization fp8 or fp8-dynamic")  # fmt: skip


def build_engine(
    model: str | None, out_dir: str | None, options: BuildOptions, cache_dir: str | None
) -> EngineManifest:
    """Build (or find already built) the engine of `model` with `options`. With no out_dir the
    engine lives in the cache, under its id."""
    from kiln.checkpoint.default_model import default_model_path

    start = time.perf_counter()
    path = default_model_path() if model is None else os.path.expanduser(model)
    if os.path.isdir(path) and is_engine_dir(path):
        raise BuildError(f"{path} is already an engine directory; build from its source")
    # A pre-quantized checkpoint's scheme decides "auto" (and refuses a contradicting one)
    # before the options name the engine.
    fp8 = prequantized.inspect(path) if os.path.isdir(path) else None
    options = replace(
        options, quantization=prequantized.resolve_quantization(options.quantization, fp8, path)
    )
    device = resolve_device("auto")
    dtype = resolve_dtype(options.dtype, device)
    gpu_class = current_gpu_class() if device.type == "cuda" else None
    check_float8_device(
        device, options.quantization, options.lm_head_quantization == "fp8",
        is_float8_kv_cache(options.kv_cache_dtype), BuildError,
        "Build without them, or on the GPU the engine will serve on (Ada or newer)",
    )  # fmt: skip
    # (Options that need a quantized build were refused when `replace` resolved "auto".)
    if fp8 is not None:
        for changes_weights, why in (
            (options.weight_rounding != "nearest",
             f'weight_rounding "{options.weight_rounding}" rounds weights from a '
             "higher-precision source"),
            (bool(options.unquantized_layers), "--unquantized-layers chooses what kiln quantizes"),
            (options.smoothing != "none",
             f'smoothing "{options.smoothing}" changes weights before they are quantized'),
            (options.outlier_columns > 0, "--outlier-columns appends weight columns kiln rounds"),
        ):  # fmt: skip
            if changes_weights:
                raise BuildError(
                    f"{path} is quantized already: its float8 weights are carried as written "
                    f"({why})"
                )
    if fp8 is None:
        calibration = _calibration_text(options)
    else:  # its weight and input scales are its own: only a float8 KV cache may calibrate
        calibration = prequantized.kv_calibration(path, fp8, options, _calibration_text)
    key = {
        **asdict(options),
        "dtype": str(dtype).removeprefix("torch."),
        "calibration_data": text_hash(calibration) if calibration else None,
        "target": gpu_class or "cpu",
    }
    del key["warm_kernels"]  # the same weights either way
    if options.tensor_parallel_size == 1:
        del key["tensor_parallel_size"]  # so unsharded engines keep their ids
    if options.lm_head_quantization == "none":
        del key["lm_head_quantization"]  # likewise engines with the head in the model dtype
    if options.weight_rounding == "nearest":
        del key["weight_rounding"]  # and engines rounded to nearest
    if options.smoothing == "none":
        del key["smoothing"]  # and unsmoothed ones
    if options.weight_rounding == "gptq-sequential":  # its defaults changed: not the old engine
        key["sequential_rounding"] = {"windows": SEQUENTIAL_WINDOWS, "damp": SEQUENTIAL_DAMP}
    if not options.unquantized_layers:
        del key["unquantized_layers"]  # and ones that quantize every projection
    if not options.outlier_columns:
        del key["outlier_columns"]  # and ones without outlier columns
    source_digest = cache.source_hash(path)
    engine_id = cache.engine_id(source_digest, key)
    cache_dir = cache_dir or (cache.default_cache_dir() if out_dir is None else None)
    cached = os.path.join(cache_dir, engine_id) if cache_dir else None
    target = os.path.abspath(os.path.expanduser(out_dir)) if out_dir else cached
    found = _already_built(engine_id, target, cached)
    if found is not None:
        print(f"engine {engine_id} was already built: {target}")
        return found
    if os.path.isdir(target) and os.listdir(target) and not is_engine_dir(target):
        raise BuildError(f"output directory {target} exists and is not an engine directory")

    source = find_model_source(path, "auto")
    cfg = source.config
    kept = _unquantized_layers(cfg, options.unquantized_layers)
    max_model_len = options.max_model_len or cfg.max_position_embeddings
    kv_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, dtype)
    plan = plan_memory(cfg, dtype, kv_dtype, options.quantization, max_model_len, device)
    print(plan.describe(), flush=True)

    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        # A pre-quantized source is always checked: its engine must equal it.
        check = options.accuracy_check and (fp8 is not None or _changes_arithmetic(options))
        calibrated = None
        if fp8 is None:
            found = _run_source(path, options, calibration, check, kept)
            kv_in_weights = True
        else:  # its own float8 weights and scales, loaded as written
            source_ppl, calibrated = prequantized.run_source(path, options, calibration, check)
            found = _SourcePass(source_ppl, fp8.input_scales, calibrated or fp8.kv_scales)
            # Its own k/v scales fold in for a float8 cache only, as loading it directly does.
            kv_in_weights = is_float8_kv_cache(options.kv_cache_dtype)
        factory = linear_method_factory(
            options.quantization, found.scales, unquantized=kept, rounded=found.rounded,
            weight_rounders=_gptq_rounders(found.hessians), outlier_channels=found.outliers,
        )  # fmt: skip

        def head() -> Fp8LinearMethod | None:  # a method serves one layer: one per model
            return Fp8LinearMethod("dynamic") if options.lm_head_quantization == "fp8" else None

        model_class = registry.model_class(cfg.architecture)
        with torch.device(device):
            # Made in `dtype` (not .to(dtype) after): float8 weights and scales keep their types.
            net = model_class(cfg, max_model_len, factory, dtype, lm_head_method=head())
        weights = source.weights
        if found.smoothing is not None:  # whole tensors, before any -tp cut
            weights = smooth_checkpoint(weights, found.smoothing, cfg)
        net.load_weights(tqdm(weights, desc="loading source", unit=" tensors", leave=False))
        if found.kv_scales is not None and kv_in_weights:
            fold_kv_scales(net, found.kv_scales)  # the weights hold them; loading folds the rest
        if options.tensor_parallel_size == 1:
            names = write_weights(net.named_parameters(), tmp)
        else:
            names = write_rank_shards(
                net, options.tensor_parallel_size, tmp,
                lambda ctx: model_class(cfg, max_model_len, factory, dtype, ctx, head()),
            )  # fmt: skip
        del net
        names += _write_side_files(path, cfg, source.tokenizer, tmp)
        tiles, tiles_reason = kernel_tiles(
            cfg, options.quantization, dtype, kv_dtype, device, gpu_class
        )
        origin = None
        if fp8 is not None:
            kv_origin = _kv_origin(fp8.kv_scales, calibrated, kv_in_weights)
            origin = prequantized.quantization_source(path, fp8, kv_origin)
        digests = hash_files([os.path.join(tmp, n) for n in names], desc="hashing engine")
        manifest = EngineManifest(
            engine_id=engine_id,
            kiln_version=kiln.__version__,
            source=os.path.abspath(path),
            source_hash=source_digest,
            architecture=cfg.to_hf_dict(),
            dtype=key["dtype"],
            kv_cache_dtype=options.kv_cache_dtype,
            max_model_len=options.max_model_len,
            quantization=options.quantization,
            scales_method=(prequantized.scales_method(fp8) if fp8 else _scales_method(options)),
            calibration_data_hash=key["calibration_data"],
            input_scales=found.scales,
            accuracy={},
            gpu_class=gpu_class,
            kernel_tiles=tiles,
            build_seconds=0.0,
            files={n: {"size": d.size, "blake2b": d.blake2b} for n, d in zip(names, digests)},
            tensor_parallel_size=options.tensor_parallel_size,
            kv_scales=None if found.kv_scales is None else [list(s) for s in found.kv_scales],
            lm_head_quantization=options.lm_head_quantization,
            kv_scales_in_weights=found.kv_scales is None or kv_in_weights,
            quantization_source=origin,
            kernel_tiles_reason=tiles_reason,
            smoothing=options.smoothing,
            unquantized_layers=kept or None,
            outlier_channels=found.outliers,
        )
        manifest.write(tmp)  # the check loads the engine from tmp: it needs a manifest
        if fp8 is None:
            accuracy = _accuracy(tmp, options, found.source_ppl)
        else:
            accuracy = prequantized.accuracy(tmp, options, found.source_ppl, calibrated is None)
        files = dict(manifest.files)
        if options.warm_kernels and device.type == "cuda" and options.tensor_parallel_size == 1:
            from kiln.builder.warm import warm_kernels

            gc.collect()
            torch.cuda.empty_cache()  # the child process's memory plan takes what is free
            # Its files are verified at load like the weights: a changed cubin is a corrupt engine.
            kernels = warm_kernels(tmp, options.kv_cache_dtype, options.max_model_len)
            kernel_digests = hash_files([os.path.join(tmp, n) for n in kernels])
            files.update(
                {n: {"size": d.size, "blake2b": d.blake2b} for n, d in zip(kernels, kernel_digests)}
            )
        manifest = EngineManifest(
            **{**asdict(manifest), "accuracy": accuracy, "files": files,
               "build_seconds": round(time.perf_counter() - start, 3)}
        )  # fmt: skip
        manifest.write(tmp)
        if accuracy.get("passed") is False and fp8 is not None:
            raise BuildError(prequantized.failure(accuracy))
        if accuracy.get("passed") is False:
            raise BuildError(_accuracy_failure(accuracy, options))
        cache.publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if cached and cached != target:
        cache.copy_engine(target, cached)
    print(f"built engine {engine_id} in {manifest.build_seconds:.1f} s: {target}")
    return manifest


def _unquantized_layers(cfg: ModelConfig, patterns: tuple[str, ...]) -> list[str]:
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


def _already_built(engine_id: str, target: str, cached: str | None) -> EngineManifest | None:
    """The finished engine at `target`, or the cache's (copied to `target`), or None."""
    for candidate in (target, cached):
        found = candidate and cache.existing_engine(candidate, engine_id)
        if found:
            if candidate != target:
                cache.copy_engine(candidate, target)
            return found
    return None


def _kv_origin(checkpoint: object, calibrated: object, folded: bool) -> str | None:
    """Where a pre-quantized build's KV cache scales came from, for its manifest."""
    if calibrated:
        return "calibrated at build time (the checkpoint has none)"
    if checkpoint:
        return "the checkpoint's k_scale/v_scale" + (
            "" if folded else " (applied when the KV cache is float8: --kv-cache-dtype fp8)"
        )
    return None


def _scales_method(options: BuildOptions) -> str | None:
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


def _calibration_text(options: BuildOptions) -> str | None:
    """The text scales are calibrated on: "fp8"'s static input scales, a float8 KV cache's
    per-layer scales, GPTQ's input statistics and smoothing's factors calibrate; nothing else
    does."""
    calibrates = (
        options.quantization == "fp8"
        or options.weight_rounding != "nearest"
        or options.smoothing != "none"
        or options.outlier_columns > 0
    )
    if not calibrates and not is_float8_kv_cache(options.kv_cache_dtype):
        return None
    from kiln.builder.accuracy import CALIBRATION_FILE

    file = options.calibration_data or CALIBRATION_FILE
    try:
        with open(file, encoding="utf-8") as f:
            return f.read() if options.calibration_data else f.read(200_000)
    except OSError as e:
        raise BuildError(f"calibration data {file} cannot be read: {e}") from e


def _write_side_files(
    source: str, cfg: ModelConfig, tokenizer: object | None, out: str
) -> list[str]:
    """config.json, tokenizer files (chat template included) and generation_config.json."""
    before = set(os.listdir(out))
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2, sort_keys=True)
    if os.path.isdir(source):
        for name in _HF_TOKENIZER_FILES:
            if os.path.isfile(os.path.join(source, name)):
                shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    else:
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
        with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(generation, f, indent=2, sort_keys=True)
    return sorted(set(os.listdir(out)) - before)


def _changes_arithmetic(options: BuildOptions) -> bool:
    return (
        options.quantization != "none"
        or options.kv_cache_dtype != "auto"
        or options.lm_head_quantization != "none"
    )


@dataclass
class _SourcePass:
    """What the build measures and calibrates on the source before the engine is made (None:
    not asked for)."""

    source_ppl: object = None
    """The held-out perplexity, if checked (a pre-quantized checkpoint's: its Scores)."""
    scales: dict[str, float] | None = None  # static input scales ("fp8")
    kv_scales: list[tuple[float, float]] | None = None  # a float8 KV cache's
    hessians: dict[str, torch.Tensor] | None = None  # GPTQ's input statistics ("gptq")
    smoothing: dict[str, torch.Tensor] | None = None  # SmoothQuant's factors
    rounded: dict | None = None  # "gptq-sequential"'s float8 weights
    outliers: dict[str, list[int]] | None = None  # --outlier-columns' channels


def _run_source(
    path: str, options: BuildOptions, calibration: str | None, check: bool, kept: list[str]
) -> _SourcePass:
    """What the options ask of the source, from one `LLM` of the unquantized source, freed
    before the quantized model is made. With smoothing, its model is smoothed before the other
    calibrations: their scales and statistics are of the smoothed inputs and weights the
    engine holds."""
    found = _SourcePass()
    if not check and calibration is None:
        return found
    from kiln.builder.accuracy import measure, measuring_llm

    with measuring_llm(path, "source", dtype=options.dtype, max_model_len=options.max_model_len,
                       enable_prefix_caching=False) as llm:  # fmt: skip
        found.source_ppl = measure(llm, options.max_model_len, "source") if check else None
        if calibration is not None:
            if options.smoothing != "none":
                found.smoothing = smooth_source(llm, path, calibration, options.smoothing)
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
                    found.outliers = _outlier_channels(amax, options.outlier_columns, kept)
            if options.weight_rounding == "gptq-sequential":  # needs the static scales
                found.rounded = round_weights(llm, calibration, found.scales, kept)
    return found


def _outlier_channels(
    amax: dict[str, torch.Tensor], count: int, kept: list[str]
) -> dict[str, list[int]]:
    """Each quantized projection's `count` loudest input channels (kept ones run unquantized)."""
    try:
        return choose_channels({n: a for n, a in amax.items() if n not in kept}, count)
    except ValueError as e:
        raise BuildError(f"--outlier-columns {count}: {e}") from None


def _gptq_rounders(hessians: dict[str, torch.Tensor] | None) -> dict | None:
    """Each projection's GPTQ row rounder, from its input statistics ("gptq")."""
    if hessians is None:
        return None
    from kiln.builder.calibrate.gptq import GPTQRows

    return {name: GPTQRows(hessian) for name, hessian in hessians.items()}


def _accuracy_failure(accuracy: dict, options: BuildOptions) -> str:
    """The failed check's one line: the numbers, and what else the user can build."""
    hints = []
    if options.quantization != "none":
        # On SmolLM2's static fp8: +5.16% to nearest, +2.07% with gptq-sequential, +0.93% with
        # outlier columns too.
        if options.weight_rounding == "nearest":
            hints.append(
                "--weight-rounding gptq-sequential fits the weights' rounding to their inputs"
            )
        if not options.outlier_columns:
            hints.append("--outlier-columns 16 keeps the loudest input channels' precision")
    hints.append("--no-accuracy-check builds it anyway")
    return (
        f"the engine's word perplexity {accuracy['engine_word_perplexity']:.4f} is "
        f"{accuracy['word_perplexity_increase_pct']:.2f}% above the source's "
        f"{accuracy['source_word_perplexity']:.4f} (limit {options.max_ppl_increase}%; "
        f"{'; '.join(hints)})"
    )


def _accuracy(engine: str, options: BuildOptions, source_ppl: dict[str, float] | None) -> dict:
    if not _changes_arithmetic(options):
        return {"checked": False, "reason": "unquantized: the weights are the source's, unchanged"}
    if source_ppl is None:
        return {"checked": False, "reason": "--no-accuracy-check"}
    from kiln.builder.accuracy import measure, measuring_llm, report

    with measuring_llm(
        engine,
        "engine",
        kv_cache_dtype=options.kv_cache_dtype,
        max_model_len=options.max_model_len,
        tensor_parallel_size=options.tensor_parallel_size,
    ) as llm:
        engine_ppl = measure(llm, options.max_model_len, "engine")
    return report(source_ppl, engine_ppl, options.max_ppl_increase)
