"""build_engine: source -> engine directory. Hash the source, return a cached engine if these
inputs were built before, print the memory plan, load (and quantize), write fused weights,
tokenizer and configs, check accuracy, write the manifest, move the directory into place."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, cast

import torch
from tqdm.auto import tqdm

import kiln
from kiln.builder import cache, fp4_source, prequantized
from kiln.builder.accuracy import check_engine, failure_message, source_perplexity_file
from kiln.builder.calibrate.smoothing import smooth_checkpoint
from kiln.builder.int4 import INT4_BUILDS, engine_quantization
from kiln.builder.int4 import build_factory as int4_factory
from kiln.builder.lora_merge import MergeAdapter, merged_source, read_adapter
from kiln.builder.manifest import EngineManifest, stamped
from kiln.builder.options import (
    BuildOptions,
    calibration_text,
    changes_arithmetic,
    scales_method,
    unquantized_layer_names,
)
from kiln.builder.plan import plan_memory
from kiln.builder.quantize import (
    SEQUENTIAL_DAMP,
    SEQUENTIAL_WINDOWS,
    SourcePass,
    gptq_rounders,
    run_source,
    text_hash,
)
from kiln.builder.tiles import kernel_tiles
from kiln.builder.weights import engine_tensors, write_rank_shards, write_weights
from kiln.checkpoint.engine_dir import current_gpu_class, is_engine_dir
from kiln.checkpoint.file_hash import hash_files
from kiln.checkpoint.fp4_formats import PrequantizedFp4
from kiln.errors import BuildError
from kiln.layers.quantization import linear_method_factory
from kiln.layers.quantization.device import check_float8_device
from kiln.layers.quantization.fp8 import Fp8LinearMethod
from kiln.models import registry
from kiln.models.config import ModelConfig
from kiln.models.kv_scales import KVScales, fold_kv_head_scales, fold_kv_scales
from kiln.models.mla_config import check_mla_kv_cache
from kiln.runtime.model_loader import (
    ModelSource,
    find_model_source,
    is_float8_kv_cache,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from kiln.tokenizer import Tokenizer

__all__ = ["BuildOptions", "build_engine"]

# Beside its target: an engine whose accuracy check failed, kept to inspect or accept.
REJECTED_SUFFIX = ".rejected"

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


@dataclass
class _Build:
    """One build's inputs, as build_engine resolves them."""

    path: str  # the source
    options: BuildOptions  # "auto" quantization resolved
    prequant: prequantized.Prequantized | None  # a pre-quantized source's scheme
    fp4: PrequantizedFp4 | None  # an FP4 source's scheme (kiln.builder.fp4_source)
    device: torch.device
    dtype: torch.dtype
    gpu_class: str | None
    calibration: str | None  # the calibration text, if any option calibrates
    key: dict  # what names the engine (with the source's hash)
    adapter: MergeAdapter | None = None  # --lora: merged into `path`'s weights before the build
    source_name: str = ""  # the source's file or directory name, for the manifest


def build_engine(
    model: str | None,
    out_dir: str | None,
    options: BuildOptions,
    cache_dir: str | None,
    accept: bool = False,
) -> EngineManifest:
    """Build (or find already built) the engine of `model` with `options`. With no out_dir the
    engine lives in the cache, under its id. An engine that fails the accuracy check is kept
    beside its target as `<target>.rejected` (loadable, to inspect) and the build raises;
    `accept` publishes such an engine (the one kept, or this build's) with the check's numbers
    and `"accepted": true` in its manifest."""
    from kiln.checkpoint.default_model import default_model_path

    start = time.perf_counter()
    path = default_model_path() if model is None else os.path.expanduser(model)
    adapter = read_adapter(options.lora) if options.lora else None
    build = _resolve(path, options, adapter)
    source_digest = cache.source_hash(path)
    engine_id = cache.engine_id(source_digest, build.key)
    ppl_root = cache_dir or os.path.dirname(cache.default_cache_dir())
    ppl_file = source_perplexity_file(
        ppl_root, _reference_digest(source_digest, adapter), build.options, build.key["dtype"],
        build.device.type,
    )  # fmt: skip
    cache_dir = cache_dir or (cache.default_cache_dir() if not out_dir else None)
    cached = os.path.join(cache_dir, engine_id) if cache_dir else None
    target = os.path.abspath(os.path.expanduser(out_dir)) if out_dir else cached
    assert target is not None  # out_dir, or else the cache's directory
    found = _already_built(engine_id, target, cached)
    if found is not None:
        print(f"engine {engine_id} was already built: {target}")
        return found
    if accept and cache.existing_engine(f"{target}{REJECTED_SUFFIX}", engine_id):
        return _accept_rejected(f"{target}{REJECTED_SUFFIX}", target, cached)
    if os.path.isdir(target) and os.listdir(target) and not is_engine_dir(target):
        raise BuildError(f"output directory {target} exists and is not an engine directory")

    with merged_source(path, adapter, target) as build.path:  # the adapter's merged in
        ids = (engine_id, source_digest)
        return _build_into(build, target, cached, ids, ppl_file, accept, start)


def _build_into(
    build: _Build,
    target: str,
    cached: str | None,
    ids: tuple[str, str],
    ppl_file: str,
    accept: bool,
    start: float,
) -> EngineManifest:
    """The build proper, from `build.path`, into `target` (or `<target>.rejected`); `ids`:
    the engine's id and its source's hash."""
    engine_id, source_digest = ids
    rejected = f"{target}{REJECTED_SUFFIX}"
    source = find_model_source(
        build.path,
        fp4_source.weights_format(build.fp4, build.options),
        quantization=build.options.quantization,
    )
    cfg, options = source.config, build.options
    check_mla_kv_cache(cfg, options.kv_cache_dtype, BuildError)
    kv_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, build.dtype)
    max_model_len = options.max_model_len or cfg.max_position_embeddings
    plan = plan_memory(
        cfg, build.dtype, kv_dtype, options.quantization, max_model_len, build.device
    )
    print(f"memory plan {plan.describe()}", flush=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        manifest, source_ppl, calibrated = _write_engine(build, source, kv_dtype, tmp, ppl_file)
        manifest = replace(manifest, engine_id=engine_id, source_hash=source_digest)
        manifest.write(tmp)  # the check loads the engine from tmp: it needs a manifest
        manifest = _check_and_warm(build, manifest, source_ppl, calibrated, tmp)
        manifest = stamped(manifest, round(time.perf_counter() - start, 3))
        failed = manifest.accuracy.get("passed") is False
        if failed and accept:
            manifest = replace(manifest, accuracy={**manifest.accuracy, "accepted": True})
        manifest.write(tmp)
        if failed and not accept:
            cache.publish(tmp, rejected)
            why = (
                prequantized.failure(manifest.accuracy)
                if build.prequant
                else failure_message(manifest.accuracy, build.options)
            )
            raise BuildError(
                f"{why}. The engine is kept, rejected, at {rejected}: load it there to inspect "
                "it, or run this build again with --accept to take it as it is"
            )
        cache.publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if cached and cached != target:
        cache.copy_engine(target, cached)
    print(f"built engine {engine_id} in {manifest.build_seconds:.1f} s: {target}")
    return manifest


def _accept_rejected(rejected: str, target: str, cached: str | None) -> EngineManifest:
    """Publish the engine an earlier build kept as rejected, its check's numbers in its
    manifest with `"accepted": true` (the manifest is no weight file: nothing else changes)."""
    manifest = EngineManifest.read(rejected)
    manifest = replace(manifest, accuracy={**manifest.accuracy, "accepted": True})
    manifest.write(rejected)
    cache.publish(rejected, target)
    if cached and cached != target:
        cache.copy_engine(target, cached)
    print(f"accepted engine {manifest.engine_id} (its accuracy check failed): {target}")
    return manifest


def _resolve(path: str, options: BuildOptions, adapter: MergeAdapter | None = None) -> _Build:
    """The build's device, dtype, scheme ("auto" resolved by a pre-quantized checkpoint's own),
    calibration text and engine key; what cannot be built is refused here, before any load."""
    if os.path.isdir(path) and is_engine_dir(path):
        raise BuildError(f"{path} is already an engine directory; build from its source")
    if adapter is not None and not os.path.isdir(path):
        raise BuildError(f"--lora merges into a Hugging Face directory's weights, not {path}")
    # A pre-quantized checkpoint's scheme decides "auto" (and refuses a contradicting one)
    # before the options name the engine.
    fp4_scheme = fp4_source.inspect_fp4(path) if os.path.isdir(path) else None
    scheme = prequantized.inspect(path) if os.path.isdir(path) and fp4_scheme is None else None
    requested = fp4_source.resolve_quantization(options.quantization, fp4_scheme)
    resolved = prequantized.resolve_quantization(requested, scheme, path)
    options = replace(options, quantization=resolved)
    device = resolve_device("auto")
    dtype = resolve_dtype(options.dtype, device)
    gpu_class = current_gpu_class() if device.type == "cuda" else None
    check_float8_device(
        device, options.quantization, options.lm_head_quantization == "fp8",
        is_float8_kv_cache(options.kv_cache_dtype), BuildError,
        "Build without them, or on the GPU the engine will serve on (Ada or newer)",
    )  # fmt: skip
    # (Options that need a quantized build were refused when `replace` resolved "auto".)
    if scheme is None:
        calibration = calibration_text(options)
    else:  # its weight and input scales are its own: only a float8 KV cache may calibrate
        _refuse_weight_changes(path, options, adapter)
        prequantized.check_tensor_parallel(path, scheme, options.tensor_parallel_size)
        calibration = prequantized.kv_calibration(path, scheme, options, calibration_text)
    key = _engine_key(options, dtype, calibration, gpu_class)
    if adapter is not None:  # its bytes name the engine, not where it lies
        key["lora"] = adapter.digest
    name = os.path.basename(os.path.normpath(path))
    return _Build(
        path, options, scheme, fp4_scheme, device, dtype, gpu_class, calibration, key, adapter, name
    )


def _refuse_weight_changes(
    path: str, options: BuildOptions, adapter: MergeAdapter | None = None
) -> None:
    """A pre-quantized checkpoint's weights are carried as written."""
    for changes_weights, why in (
        (adapter is not None, "--lora merges an adapter into higher-precision weights"),
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
                f"{path} is quantized already: its weights are carried as written ({why})"
            )


def _engine_key(
    options: BuildOptions, dtype: torch.dtype, calibration: str | None, gpu_class: str | None
) -> dict:
    """What names the engine besides its source: options at their defaults are left out, so
    engines built before an option existed keep their ids."""
    key = {
        **asdict(options),
        "dtype": str(dtype).removeprefix("torch."),
        "calibration_data": text_hash(calibration) if calibration else None,
        "target": gpu_class or "cpu",
    }
    del key["warm_kernels"]  # the same weights either way
    defaults = {
        "tensor_parallel_size": 1, "lm_head_quantization": "none", "weight_rounding": "nearest",
        "smoothing": "none", "unquantized_layers": (), "outlier_columns": 0, "lora": None,
    }  # fmt: skip
    for name, default in defaults.items():
        if getattr(options, name) == default:
            del key[name]
    if options.weight_rounding == "gptq-sequential":  # its defaults changed: not the old engine
        key["sequential_rounding"] = {"windows": SEQUENTIAL_WINDOWS, "damp": SEQUENTIAL_DAMP}
    return key


def _reference_digest(source_digest: str, adapter: MergeAdapter | None) -> str:
    """What the accuracy check's reference is: the source, or the source with the adapter
    merged (its perplexity is kept under this)."""
    if adapter is None:
        return source_digest
    return hashlib.blake2b(f"{source_digest}+lora:{adapter.digest}".encode()).hexdigest()


def _write_engine(
    build: _Build, source: ModelSource, kv_dtype: torch.dtype, tmp: str, ppl_file: str
) -> tuple[EngineManifest, dict[str, float] | prequantized.Scores | None, KVScales | None]:
    """Calibrate on the source, load it into the scheme's model, write the weights and side
    files into `tmp`: (the manifest of what was written, its id and accuracy to come; the
    source's perplexity if checked; a pre-quantized source's KV scales calibrated here)."""
    options, cfg = build.options, source.config
    # A source that keeps layers unquantized itself (gpt-oss's MXFP4 attention) keeps them so.
    kept = unquantized_layer_names(cfg, options.unquantized_layers) or list(
        source.unquantized_layers
    )
    # A pre-quantized source is always checked: its engine must equal it.
    check = options.accuracy_check and (build.prequant is not None or changes_arithmetic(options))
    calibrated = None
    if build.prequant is None:
        found = run_source(
            build.path, options, build.calibration, check, kept, ppl_file,
            fp4_source.source_format(build.fp4),
        )  # fmt: skip
        kv_in_weights = True
    else:  # its own weights and scales, loaded as written
        source_ppl, calibrated = prequantized.run_source(
            build.path, options, build.calibration, check
        )
        own_kv = prequantized.kv_scales(build.prequant)
        found = SourcePass(
            source_ppl, prequantized.input_scales(build.prequant), calibrated or own_kv
        )
        # Its own k/v scales fold in for a float8 cache only, as loading it directly does.
        kv_in_weights = is_float8_kv_cache(options.kv_cache_dtype)
    names = _write_weights(build, source, found, kept, kv_in_weights, tmp)
    names += _write_side_files(build.path, cfg, source.tokenizer, tmp)
    origin = None
    if build.prequant is not None:
        own_kv = prequantized.kv_scales(build.prequant)
        kv_origin = _kv_origin(own_kv, calibrated, kv_in_weights)
        origin = prequantized.quantization_source(build.path, build.prequant, kv_origin)
    if build.fp4 is not None:
        origin = fp4_source.quantization_source(
            build.fp4, fp4_source.weights_format(build.fp4, options)
        )
    tiles, tiles_reason = kernel_tiles(
        cfg, options.quantization, build.dtype, kv_dtype, build.device, build.gpu_class
    )
    digests = hash_files([os.path.join(tmp, n) for n in names], desc="hashing engine")
    manifest = EngineManifest(
        engine_id="",
        kiln_version=kiln.__version__,
        source=build.source_name,
        source_hash="",
        architecture=cfg.to_hf_dict(),
        dtype=build.key["dtype"],
        kv_cache_dtype=options.kv_cache_dtype,
        max_model_len=options.max_model_len,
        quantization=engine_quantization(options.quantization, cfg),
        scales_method=(
            prequantized.scales_method(build.prequant) if build.prequant else scales_method(options)
        ),
        calibration_data_hash=build.key["calibration_data"],
        input_scales=found.scales,
        accuracy={},
        gpu_class=build.gpu_class,
        kernel_tiles=tiles,
        build_seconds=0.0,
        files={n: {"size": d.size, "blake2b": d.blake2b} for n, d in zip(names, digests)},
        tensor_parallel_size=options.tensor_parallel_size,
        kv_scales=None if found.kv_scales is None else [list(s) for s in found.kv_scales],
        lm_head_quantization=options.lm_head_quantization,
        kv_scales_in_weights=found.kv_scales is None or kv_in_weights,
        kv_head_scales=None
        if found.kv_head_scales is None
        else [[list(k), list(v)] for k, v in found.kv_head_scales],
        quantization_source=origin,
        kernel_tiles_reason=tiles_reason,
        smoothing=options.smoothing,
        unquantized_layers=kept or None,
        outlier_channels=found.outliers,
        lora_adapter=None if build.adapter is None else build.adapter.manifest_entry(),
    )
    return manifest, found.source_ppl, calibrated


def _write_weights(
    build: _Build,
    source: ModelSource,
    found: SourcePass,
    kept: list[str],
    kv_in_weights: bool,
    tmp: str,
) -> list[str]:
    """The source's weights through the scheme's linear methods (quantized as they arrive),
    KV scales folded, written as one set of shards or one per tensor rank."""
    options, cfg, dtype = build.options, source.config, build.dtype
    max_model_len = options.max_model_len or cfg.max_position_embeddings
    if options.quantization in INT4_BUILDS:
        assert found.rounded is not None, "the source pass rounded every INT4 projection"
        factory = int4_factory(found.rounded, kept)
    else:
        factory = linear_method_factory(
            options.quantization, found.scales, unquantized=kept, rounded=found.rounded,
            weight_rounders=gptq_rounders(found.hessians), outlier_channels=found.outliers,
        )  # fmt: skip

    def head() -> Fp8LinearMethod | None:  # a method serves one layer: one per model
        return Fp8LinearMethod("dynamic") if options.lm_head_quantization == "fp8" else None

    model_class = registry.model_class(cfg.architecture)
    with torch.device(build.device):
        # Made in `dtype` (not .to(dtype) after): float8 weights and scales keep their types.
        net = model_class(cfg, max_model_len, factory, dtype, lm_head_method=head())
    weights = source.weights
    assert weights is not None, "a build's source is a checkpoint, not dummy weights"
    if found.smoothing is not None:  # whole tensors, before any -tp cut
        weights = smooth_checkpoint(weights, found.smoothing, cfg)
    total = _tensor_count(build.path)
    net.load_weights(
        tqdm(weights, desc="loading source", unit=" tensors", total=total, leave=False)
    )
    if found.kv_scales is not None and kv_in_weights:
        fold_kv_scales(net, found.kv_scales)  # the weights hold them; loading folds the rest
    if found.kv_head_scales is not None:
        # What the blocks folded (a layer's largest where a shape takes no per-head scale).
        found.kv_head_scales = fold_kv_head_scales(net, found.kv_head_scales)
    if options.tensor_parallel_size == 1:
        return write_weights(engine_tensors(net), tmp)
    return write_rank_shards(
        net, options.tensor_parallel_size, tmp,
        lambda ctx: model_class(cfg, max_model_len, factory, dtype, ctx, head()),
    )  # fmt: skip


def _tensor_count(path: str) -> int | None:
    """How many tensors the source's checkpoint holds, from its headers alone (the loading
    bar's total); None if they cannot be counted."""
    try:
        if os.path.isfile(path):  # GGUF (its rope_freqs table is no weight)
            from kiln.checkpoint.gguf_loader import GGUFModel

            return sum(1 for name in GGUFModel(path).tensor_types if name != "rope_freqs.weight")
        from safetensors import safe_open

        count = 0
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                with safe_open(os.path.join(path, name), framework="pt") as f:
                    count += len(list(f.keys()))
        return count or None
    except Exception:  # a count for a progress bar: the load itself reports what is wrong
        return None


def _check_and_warm(
    build: _Build,
    manifest: EngineManifest,
    source_ppl: dict[str, float] | prequantized.Scores | None,
    calibrated: KVScales | None,
    tmp: str,
) -> EngineManifest:
    """The accuracy check of the engine in `tmp` (its verdict in the manifest returned), and on
    a GPU its compiled kernels carried in it."""
    options = build.options
    if build.prequant is None:
        assert not isinstance(source_ppl, prequantized.Scores)  # a checkpoint's perplexities
        accuracy = check_engine(
            tmp, options, source_ppl, ModelConfig.from_hf_dict(manifest.architecture)
        )
    else:
        assert not isinstance(source_ppl, dict)  # a pre-quantized checkpoint's scores
        accuracy = prequantized.accuracy(tmp, options, source_ppl, calibrated is None)
    files = dict(manifest.files)
    if options.warm_kernels and build.device.type == "cuda" and options.tensor_parallel_size == 1:
        from kiln.builder.warm import warm_kernels

        gc.collect()
        torch.cuda.empty_cache()  # the child process's memory plan takes what is free
        # Its files are verified at load like the weights: a changed cubin is a corrupt engine.
        kernels = warm_kernels(tmp, options.kv_cache_dtype, options.max_model_len)
        kernel_digests = hash_files([os.path.join(tmp, n) for n in kernels])
        files.update(
            {n: {"size": d.size, "blake2b": d.blake2b} for n, d in zip(kernels, kernel_digests)}
        )
    return replace(manifest, accuracy=accuracy, files=files)


def _already_built(engine_id: str, target: str, cached: str | None) -> EngineManifest | None:
    """The finished engine at `target`, or the cache's (copied to `target`), or None."""
    for candidate in (target, cached):
        if not candidate:
            continue
        found = cache.existing_engine(candidate, engine_id)
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


def _write_side_files(
    source: str, cfg: ModelConfig, tokenizer: Tokenizer | None, out: str
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
            # The loader's tokenizers are transformers ones (a GGUF file's is built as one).
            cast("PreTrainedTokenizerBase", tokenizer).save_pretrained(out)
        generation = {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids)}
        with open(os.path.join(out, "generation_config.json"), "w", encoding="utf-8") as f:
            json.dump(generation, f, indent=2, sort_keys=True)
    return sorted(set(os.listdir(out)) - before)
