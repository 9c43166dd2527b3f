"""Finds a model (embedded default, HF directory, GGUF file, preset, hub id), builds it on the
device in the chosen dtype and fills its weights."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from kiln.config import EngineConfig
from kiln.distributed.parallel_state import ParallelContext
from kiln.errors import ModelLoadError
from kiln.layers.linear import LinearMethod
from kiln.layers.quantization import linear_method_factory
from kiln.layers.quantization.device import check_float8_device
from kiln.models import registry
from kiln.models.base import CausalLM
from kiln.models.blocks import LinearMethodFactory
from kiln.models.config import PRESETS, ModelConfig
from kiln.models.decoder import DecoderForCausalLM, shard_config
from kiln.models.mla_config import check_mla_kv_cache
from kiln.models.moe_config import PER_CHANNEL_8BIT, ROW_BLOCK_8BIT
from kiln.runtime.config_plan import plan_from_config
from kiln.tokenizer import Tokenizer, from_transformers

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelSource:
    """A model before it is built: its shape, where its weights come from, its tokenizer."""

    config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]] | None  # None: dummy weights
    tokenizer: Tokenizer | None  # None: none, or still loading (tokenizer_future)
    generation_defaults: dict
    description: str
    # True for an engine directory: kiln-named, already fused tensors (load_fused_weights).
    weights_fused: bool = False
    # An engine directory's or a pre-quantized checkpoint's scheme ("none", "fp8",
    # "fp8-dynamic"): its model must be built with that scheme's linear methods before its
    # (already quantized) tensors load.
    quantization: str = "none"
    # A GGUF file's integer projections (load_format="gguf-int"): each layer's own scheme, by
    # the layer's name ("layers.3.self_attn.qkv_proj"); `quantization` joins them with "+".
    layer_quantization: dict[str, str] | None = None
    input_scales: dict[str, float] | None = None  # an "fp8" engine's calibrated static scales
    # > 1: an engine built with `kiln build -tp N`; `weights` are then one tensor rank's, cut.
    tensor_parallel_size: int = 1
    # Per-layer (k_scale, v_scale) of a float8 KV cache: an engine's weights hold them already
    # (kv_scales_in_weights); a pre-quantized checkpoint's are folded in when the cache is float8.
    kv_scales: list[tuple[float, float]] | None = None
    kv_scales_in_weights: bool = False
    # Per layer ([k scale per KV head], [v scale per KV head]) of an int8 KV cache: an engine
    # built with `--kv-cache-dtype int8` holds them in its weights already.
    kv_head_scales: list | None = None
    # An engine built with a float8 LM head (`kiln build --lm-head-quantization fp8`).
    lm_head_quantization: str = "none"
    # An engine's decoder projections kept in the model dtype (`kiln build --unquantized-layers`).
    unquantized_layers: tuple[str, ...] = ()
    # An engine's outlier columns (`kiln build --outlier-columns`): layer name -> input channels.
    outlier_channels: dict[str, list[int]] | None = None
    # The tokenizer loading on a thread (find_model_source(background_tokenizer=True)).
    tokenizer_future: Future[Tokenizer | None] | None = None


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    generation_defaults: dict
    description: str
    load_seconds: float
    # Seconds of each part of the load (device work waited for at each edge): where a start's
    # time goes (ExecutorStats.startup["load_phases"]).
    phases: dict[str, float] | None = None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' was asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # fp32 on the CPU: faster than bf16 there, and exact against the HF oracle.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def is_float8_kv_cache(name: str) -> bool:
    """Whether a kv_cache_dtype name ("auto", "fp8", "fp8_e4m3") asks for a float8 cache."""
    return name in ("fp8", "fp8_e4m3")


def is_int8_kv_cache(name: str) -> bool:
    """Whether a kv_cache_dtype name asks for an int8 cache (codes with per-head scales)."""
    return name == "int8"


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's own, float8 e4m3 ("fp8") or int8 ("int8")."""
    if name == "auto":
        return model_dtype
    if is_int8_kv_cache(name):
        return torch.int8
    return torch.float8_e4m3fn  # "fp8" / "fp8_e4m3" (validated by EngineConfig)


def find_model_source(
    model: str | None,
    load_format: str,
    tp_rank: int = 0,
    device: torch.device | None = None,
    background_tokenizer: bool = False,
    engine_kernels: bool = False,
    quantization: str = "none",
) -> ModelSource:
    """`tp_rank`: which tensor rank's weights to read from an engine built with one shard per
    rank (other sources hold the whole model, which each rank cuts as it loads). `quantization`:
    the scheme asked for, which an FP4 checkpoint converts to (PrequantizedFp4.conversion).
    `device`: where an engine directory's weights are read to (its shards go there directly).
    `background_tokenizer`: an engine directory's tokenizer loads on a thread while the weights
    are read, as `tokenizer_future` (load_model waits for it). `engine_kernels`: an
    engine directory's compiled kernels go into the Triton cache before anything compiles
    (EngineConfig.engine_kernel_cache)."""
    from kiln.checkpoint.default_model import default_model_path
    from kiln.checkpoint.engine_dir import is_engine_dir

    path = default_model_path() if model is None else os.path.expanduser(model)
    if load_format == "dummy":
        return _dummy_source(path)
    if load_format == "gguf-int" and not path.endswith(".gguf"):
        raise ModelLoadError(f'load_format "gguf-int" reads GGUF files, not {path}')
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _gguf_source(path, integer=load_format == "gguf-int")
    if os.path.isdir(path) and is_engine_dir(path):
        return _engine_dir_source(
            path, tp_rank, device or torch.device("cpu"), background_tokenizer, engine_kernels
        )
    if os.path.isdir(path):
        return _hf_dir_source(path, load_format == "dequantized", quantization)
    if model in PRESETS:
        raise ModelLoadError(
            f"{model!r} is an architecture preset: it has no weights; pass load_format='dummy'"
        )
    assert model is not None, "the default model is a .gguf file"
    return _hub_source(model)


def _gguf_source(path: str, integer: bool = False) -> ModelSource:
    """`integer`: the file's projections on the integer methods (kiln.checkpoint.gguf_int), each
    layer on the one its parts' types map to; else (and by default) every tensor dequantized."""
    from kiln.checkpoint import gguf_int
    from kiln.checkpoint.gguf_loader import GGUFModel

    gguf_model = GGUFModel(path)
    layers: dict[str, str] | None = None
    tensors: dict[str, str] | None = None
    if integer:
        model_class = registry.model_class(gguf_model.config.architecture)
        assert issubclass(model_class, DecoderForCausalLM), "GGUF's families are decoders"
        types = gguf_model.projection_types()
        try:
            layers, tensors = gguf_int.projection_schemes(types, model_class.layer_tensor_map)
        except ValueError as e:
            raise ModelLoadError(
                f'{path}: load_format "gguf-int" cannot keep its projections integer: {e}; load '
                "the file as it is (dequantized: the default load_format)"
            ) from e
    source = ModelSource(
        gguf_model.config,
        gguf_model.tensors(tensors),
        from_transformers(gguf_model.tokenizer()),
        {},
        f"GGUF {path}",
    )
    if layers:
        # One name for the methods (each layer's own comes from layer_quantization).
        source.quantization = "+".join(sorted(set(layers.values())))
        source.layer_quantization = layers
        source.description += f" ({source.quantization})"
    return source


def _engine_dir_source(
    path: str,
    tp_rank: int,
    device: torch.device,
    background_tokenizer: bool = False,
    engine_kernels: bool = False,
) -> ModelSource:
    from kiln.checkpoint.engine_dir import iter_engine_weights, open_engine_dir, rank_dir_name
    from kiln.checkpoint.safetensors_loader import read_generation_config
    from kiln.kernel_cache.triton_cache import install

    engine = open_engine_dir(path)  # version, GPU class, sizes; the shards' hashes as they load
    if engine_kernels:
        # Its compiled device code, only what the manifest lists and hashes, before any compile.
        install(path, engine.manifest["files"])
    tp = engine.manifest.get("tensor_parallel_size", 1)
    weights_dir = path if tp == 1 else os.path.join(path, rank_dir_name(tp_rank, tp))
    if background_tokenizer:
        # Importing transformers and parsing tokenizer.json take seconds of a cold start
        # (7.9 s of SmolLM2's engine load on the loaded 2-core CPU); the weight reader's threads
        # mostly release the GIL, so the two overlap.
        pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kiln-tokenizer")
        tokenizer, future = None, pool.submit(_load_engine_tokenizer, path)
        pool.shutdown(wait=False)
    else:
        tokenizer, future = _load_engine_tokenizer(path), None
    return ModelSource(
        engine.config,
        iter_engine_weights(engine, weights_dir, device),
        tokenizer,
        read_generation_config(path),
        engine.description,
        weights_fused=True,
        quantization=engine.manifest["quantization"],
        input_scales=engine.manifest.get("input_scales"),
        tensor_parallel_size=tp,
        kv_scales=engine.manifest.get("kv_scales"),
        # False: a pre-quantized checkpoint's scales, folded at load for a float8 cache only.
        kv_scales_in_weights=engine.manifest.get("kv_scales_in_weights", True),
        kv_head_scales=engine.manifest.get("kv_head_scales"),
        lm_head_quantization=engine.manifest.get("lm_head_quantization", "none"),
        unquantized_layers=tuple(engine.manifest.get("unquantized_layers") or ()),
        outlier_channels=engine.manifest.get("outlier_channels"),
        tokenizer_future=future,
    )


class DummyInputScales(Mapping[str, float]):
    """Static input scales for dummy weights, one for every projection: `quantization="fp8"`
    (TensorRT-LLM's headline FP8 setup, per-tensor activation scales) then runs on a preset
    without a calibrated build, as dummy weights stand in for a checkpoint's. Its speed does
    not depend on the value: 4 / 448 puts the RMSNorm outputs of the dummy draw (about unit
    variance) inside e4m3's range."""

    SCALE = 4.0 / 448.0

    def __getitem__(self, name: str) -> float:
        return self.SCALE

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def _has_own_scheme(source: ModelSource) -> bool:
    """An engine directory or a pre-quantized checkpoint: its weights carry their quantization;
    any other source takes EngineConfig.quantization."""
    return source.weights_fused or source.quantization != "none"


def _weight_scheme(engine_config: EngineConfig, source: ModelSource) -> str:
    """The weights' quantization (see _has_own_scheme)."""
    return source.quantization if _has_own_scheme(source) else _online_scheme(engine_config, source)


def _online_scheme(engine_config: EngineConfig, source: ModelSource) -> str:
    """The scheme a source without its own quantizes to as it loads. "fp8" means what it means
    to vLLM: float8 weights with dynamic per-token activation scales, since nothing calibrated
    static ones (a `kiln build --quantization fp8` engine carries them); dummy weights keep
    stand-in static scales (DummyInputScales), so benchmarks measure the static setup."""
    if engine_config.quantization == "fp8" and source.weights is not None:
        return "fp8-dynamic"
    return engine_config.quantization


def _linear_method(engine_config: EngineConfig, source: ModelSource) -> LinearMethodFactory:
    """An engine directory's or a pre-quantized checkpoint's own scheme (and its static scales)
    make its linear methods; any other source takes EngineConfig.quantization."""
    if not _has_own_scheme(source):
        if engine_config.quantization.startswith("int4") and source.weights is not None:
            raise ModelLoadError(
                f"{source.description}: kiln does not quantize to INT4 while loading; "
                f"quantization={engine_config.quantization!r} runs dummy weights (load a GPTQ, "
                "AWQ or compressed-tensors INT4 checkpoint as it is)"
            )
        scheme = _online_scheme(engine_config, source)
        if scheme != engine_config.quantization:
            logger.info(
                'quantization "fp8" of %s: float8 weights, activations scaled per token at '
                "run time (static scales need an engine built with `kiln build --quantization "
                "fp8`)",
                source.description,
            )
        dummy_static = source.weights is None and scheme == "fp8"
        return linear_method_factory(scheme, DummyInputScales() if dummy_static else None)
    # "fp8" names any float8 checkpoint's own scheme, as vLLM's --quantization fp8 does.
    any_fp8 = engine_config.quantization == "fp8" and source.quantization.startswith("fp8")
    if not any_fp8 and engine_config.quantization not in ("none", source.quantization):
        raise ModelLoadError(
            f"{source.description} holds {source.quantization!r} weights; it cannot load as "
            f"quantization={engine_config.quantization!r} (build another engine for that)"
        )
    if source.layer_quantization is not None:
        return linear_method_factory(source.quantization, layers=source.layer_quantization)
    return linear_method_factory(
        source.quantization, source.input_scales, unquantized=source.unquantized_layers,
        outlier_channels=source.outlier_channels,
    )  # fmt: skip


def _check_float8_device(
    engine_config: EngineConfig, source: ModelSource, device: torch.device
) -> None:
    """A clear error before anything loads when float8 weights, a float8 LM head or a float8 KV
    cache meet a GPU without float8 (kiln.layers.quantization.device)."""
    check_float8_device(
        device, _weight_scheme(engine_config, source), _float8_head(engine_config, source),
        is_float8_kv_cache(engine_config.kv_cache_dtype), ModelLoadError,
        "Run without them (--quantization none, --kv-cache-dtype auto, --lm-head-quantization "
        "none; an engine built with them cannot), or on a newer GPU",
    )  # fmt: skip


def _fold_int8_kv_scales(
    engine_config: EngineConfig, source: ModelSource, model: CausalLM, tokenizer: Tokenizer | None
) -> None:
    """An int8 engine's per-head KV scales (in its weights already: the softmax's share folds
    here), or, for an int8 cache over a model that brings none, the scales measured now
    (kiln.runtime.kv_calibration's default)."""
    from kiln.models.kv_scales import fold_kv_head_scales

    if source.kv_head_scales is not None:
        start = model.layer_start  # a pipeline stage holds layers start..start + len - 1
        scales = source.kv_head_scales[start : start + len(model.layers)]
        fold_kv_head_scales(model, scales, into_weights=False)
    elif is_int8_kv_cache(engine_config.kv_cache_dtype):
        from kiln.runtime.kv_calibration import load_time_head_scales

        if model.parallel is not None:
            raise ModelLoadError(
                "an int8 KV cache measures its scales at load in one process only: build an "
                "engine with `kiln build --kv-cache-dtype int8` for tensor or pipeline parallelism"
            )
        scales = load_time_head_scales(model, tokenizer)
        fold_kv_head_scales(model, scales)
        logging.getLogger("kiln.startup").info(
            "int8 KV cache: per-head scales measured at load over a built-in text"
        )


def _float8_head(engine_config: EngineConfig, source: ModelSource) -> bool:
    """Asked for, or the engine's head is float8 already."""
    return "fp8" in (engine_config.lm_head_quantization, source.lm_head_quantization)


def lm_head_method(engine_config: EngineConfig, source: ModelSource) -> LinearMethod | None:
    """The LM head's method: float8 (weights per vocabulary row, activations per token) when
    asked for or when the engine's head is float8 already; None: the model dtype."""
    if not _float8_head(engine_config, source):
        return None
    from kiln.layers.quantization.fp8 import Fp8LinearMethod

    return Fp8LinearMethod("dynamic")


def _load_engine_tokenizer(path: str) -> Tokenizer | None:
    """A plain fast tokenizer (what a GGUF source's becomes) loads without AutoTokenizer, whose
    imports add seconds to a cold start (3 s on a 2-core CPU host); others go through it."""
    config_file = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(os.path.join(path, "tokenizer.json")) and os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
        if tokenizer_class in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            from transformers import PreTrainedTokenizerFast

            try:
                return from_transformers(PreTrainedTokenizerFast.from_pretrained(path))
            except Exception as exc:  # a broken tokenizer file must say which directory
                raise ModelLoadError(f"could not load the tokenizer in {path}: {exc}") from exc
    return _load_tokenizer(path)


def _hf_dir_source(path: str, dequantized: bool = False, quantization: str = "none") -> ModelSource:
    """`dequantized`: an FP4 checkpoint's weights run in the model dtype, not converted to FP8
    (else to `quantization`'s scheme: PrequantizedFp4.conversion)."""
    from kiln.checkpoint.eight_bit_formats import eight_bit_tensors, read_eight_bit
    from kiln.checkpoint.fp4_formats import fp4_tensors, read_fp4
    from kiln.checkpoint.int4_formats import int4_tensors, read_int4
    from kiln.checkpoint.prequantized import read_prequantized
    from kiln.checkpoint.safetensors_loader import (
        load_hf_checkpoint,
        read_generation_config,
        read_hf_config,
    )

    hf_config = read_hf_config(path)
    eight_bit = read_eight_bit(path, hf_config)
    int4 = read_int4(path, hf_config) if eight_bit is None else None
    fp4 = read_fp4(path, hf_config) if int4 is None and eight_bit is None else None
    fp8 = None
    if int4 is None and eight_bit is None and fp4 is None:
        fp8 = read_prequantized(path, hf_config)
    other = int4 or fp8 or eight_bit
    if dequantized and other is not None:
        raise ModelLoadError(
            f"{path}: load_format 'dequantized' widens FP4 checkpoints; this one is "
            f"{other.producer} {other.quantization}"
        )
    config, weights = load_hf_checkpoint(
        path, allow_fp8=fp8 is not None or eight_bit is not None,
        allow_int=bool(int4) or eight_bit is not None, allow_fp4=fp4 is not None,
    )  # fmt: skip
    if int4 is not None:
        weights = int4_tensors(weights, int4)
    fp4_target = None if fp4 is None or dequantized else fp4.conversion(quantization)
    if fp4 is not None:
        weights = fp4_tensors(weights, fp4, fp4_target)
    if eight_bit is not None:
        # Experts take 8-bit weights per channel (kiln.layers.moe_w8a16), int8 in groups of 128
        # or float8 in 128x128 blocks.
        if config.num_experts and eight_bit.quantization not in (
            *ROW_BLOCK_8BIT,
            *PER_CHANNEL_8BIT,
        ):
            raise ModelLoadError(
                f"{path}: {eight_bit.quantization} ({eight_bit.producer}) checkpoints of "
                "mixture-of-experts models are not supported yet (kiln's 8-bit experts load "
                "per output channel, int8 in groups of 128 or FP8 in 128x128 blocks)"
            )
        weights = eight_bit_tensors(weights, eight_bit)
    source = ModelSource(
        config, weights, _load_tokenizer(path), read_generation_config(path), f"HF {path}"
    )
    if int4 is not None:
        source.description = f"HF {path} ({int4.producer} {int4.quantization})"
        source.quantization = int4.quantization
    if eight_bit is not None:
        source.description = f"HF {path} ({eight_bit.producer} {eight_bit.quantization})"
        source.quantization = eight_bit.quantization
    if fp4 is not None:
        what = f"{fp4.producer} {fp4.format}"
        if dequantized:
            source.description = f"HF {path} ({what}, dequantized)"
        else:  # converted as each weight arrives (float8 per output channel by default)
            assert fp4_target is not None
            source.description = f"HF {path} ({what} -> {fp4_target})"
            source.quantization = fp4_target
            if fp4.producer == "openai":  # its attention ships unquantized: keep it so
                source.unquantized_layers = tuple(
                    f"layers.{i}.self_attn.{p}"
                    for i in range(config.num_hidden_layers)
                    for p in ("qkv_proj", "o_proj")
                )
    if fp8 is not None:
        source.description = f"HF {path} ({fp8.producer} {fp8.quantization})"
        source.quantization, source.input_scales = fp8.quantization, fp8.input_scales
        source.kv_scales = fp8.kv_scales
        if config.num_experts:  # its experts' scales per channel (or per tensor) load as theirs
            source.config = dataclasses.replace(config, per_channel_experts=True)
    return source


def _load_tokenizer(path: str) -> Tokenizer | None:
    has_tokenizer = any(
        os.path.exists(os.path.join(path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_tokenizer:
        return None  # before importing transformers: that import alone is seconds of a start
    from transformers import AutoTokenizer

    try:
        return from_transformers(AutoTokenizer.from_pretrained(path))
    except Exception as exc:  # a broken tokenizer file must say which directory
        raise ModelLoadError(f"could not load the tokenizer in {path}: {exc}") from exc


def _dummy_source(name: str) -> ModelSource:
    if name in PRESETS:
        return ModelSource(ModelConfig.from_hf_dict(PRESETS[name]), None, None, {}, f"dummy {name}")
    config_file = os.path.join(name, "config.json")
    if os.path.isfile(config_file):
        with open(config_file, encoding="utf-8") as f:
            config = ModelConfig.from_hf_dict(json.load(f))
        return ModelSource(config, None, _load_tokenizer(name), {}, f"dummy {name}")
    if name.endswith(".gguf") and os.path.isfile(name):
        from kiln.checkpoint.gguf_loader import GGUFModel

        gguf_model = GGUFModel(name)
        tokenizer = from_transformers(gguf_model.tokenizer())
        return ModelSource(gguf_model.config, None, tokenizer, {}, f"dummy {name}")
    known = ", ".join(sorted(PRESETS))
    raise ModelLoadError(
        f"load_format='dummy' needs a preset ({known}), an HF directory or a GGUF file; "
        f"got {name!r}"
    )


def _hub_source(model_id: str) -> ModelSource:
    """A hub id: download it with huggingface_hub (only works where a network exists)."""
    if model_id.count("/") != 1 or model_id.startswith((".", "/")):
        raise ModelLoadError(
            f"model {model_id!r} not found: not a directory, not a .gguf file, not a hub id"
        )
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            model_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"]
        )
    except Exception as exc:
        raise ModelLoadError(
            f"model {model_id!r} is not a local path, and downloading it from the Hugging Face "
            f"hub failed ({type(exc).__name__}: {exc})"
        ) from exc
    return _hf_dir_source(local)


def _memory_of(device: torch.device) -> tuple[int, str]:
    """(bytes, what) the weights must fit in: the GPU's total memory, or the host's RAM."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory, f"{device} memory"
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host memory"


def _log_config_plan(
    engine_config: EngineConfig,
    cfg: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """How many sequences of each length the KV cache will hold, from the config alone, before
    the weights are read (the profiled plan after loading is the one the engine uses)."""
    kv_dtype = resolve_kv_cache_dtype(engine_config.kv_cache_dtype, dtype)
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    plan = plan_from_config(cfg, engine_config, max_model_len, dtype, kv_dtype, total)
    logging.getLogger("kiln.startup").info("memory plan %s", plan.describe())


def load_model(
    engine_config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    parallel: ParallelContext | None = None,
) -> LoadedModel:
    """The model, or under TP/PP this rank's part of it (`parallel`): each rank reads the
    checkpoint and keeps only its heads, rows and layers."""
    start = time.perf_counter()
    clock = _PhaseClock(device)
    if device.type == "cuda":
        torch.empty(0, device=device)  # the CUDA context, on its own line of the breakdown
        clock.mark("cuda_init_s")
    tp_rank = 0 if parallel is None else parallel.tp_rank
    source = find_model_source(
        engine_config.model, engine_config.load_format, tp_rank, device,
        background_tokenizer=True, engine_kernels=engine_config.engine_kernel_cache,
        quantization=engine_config.quantization,
    )  # fmt: skip
    clock.mark("source_s")  # manifest, file checks, tokenizer (not an engine's), carried kernels
    if source.tensor_parallel_size not in (1, engine_config.tensor_parallel_size):
        raise ModelLoadError(
            f"{source.description} holds one weight shard per rank for tensor_parallel_size="
            f"{source.tensor_parallel_size}; it cannot load at tensor_parallel_size="
            f"{engine_config.tensor_parallel_size} (build another engine, or build without -tp)"
        )
    if engine_config.load_format == "gguf-int" and engine_config.tensor_parallel_size > 1:
        # The integer methods cut per rank, but no test holds a GGUF file's cut to one process.
        raise ModelLoadError(
            'load_format "gguf-int" runs at tensor_parallel_size=1 only; load the GGUF file '
            "dequantized (the default load_format) under tensor parallelism"
        )
    cfg = source.config
    check_mla_kv_cache(cfg, engine_config.kv_cache_dtype, ModelLoadError)
    if source.tensor_parallel_size > 1 and cfg.num_experts and engine_config.enable_expert_parallel:
        raise ModelLoadError(
            f"{source.description} holds tensor-parallel slices of every expert (kiln build "
            "-tp); enable_expert_parallel loads whole experts from an engine built without -tp "
            "or from the checkpoint"
        )
    max_positions = engine_config.max_model_len or cfg.max_position_embeddings
    linear_method = _linear_method(engine_config, source)
    _check_float8_device(engine_config, source, device)
    # Quantized weights may take one byte each: the check must not refuse what would fit.
    quantized = engine_config.quantization != "none" or source.quantization != "none"
    weight_bytes = 1 if quantized else dtype.itemsize  # a pre-quantized checkpoint's too
    # Under TP/PP a rank holds its shard (its experts too): that must fit its device.
    shard_config(cfg, parallel).check_fits(weight_bytes, *_memory_of(device))
    if parallel is None:  # (under TP/PP each rank's share differs: the profiled plan tells)
        _log_config_plan(engine_config, cfg, max_positions, dtype, device)
    with torch.device(device):
        # Made in `dtype`, not `.to(dtype)` after: float8 weights and fp32 scales keep their types.
        model = registry.model_class(cfg.architecture)(
            cfg,
            max_positions,
            linear_method,
            dtype,
            parallel,
            lm_head_method(engine_config, source),
        )
    # Rotary tables stay fp32, holding the model dtype's values (transformers rounds cos/sin to
    # the activations' dtype too).
    model.cos_sin_cache = model.cos_sin_cache.to(dtype).float()
    clock.mark("construct_s")
    if source.weights is None:
        model.init_dummy_weights(engine_config.seed)
    elif source.weights_fused:
        # The reader's tensors are fresh verified buffers of their own: the model takes them.
        model.load_fused_weights(source.weights, cut=source.tensor_parallel_size == 1, adopt=True)
    else:
        model.load_weights(source.weights)
    clock.mark("weights_s")  # read, hashed, copied to the device, taken by the parameters
    float8_cache = is_float8_kv_cache(engine_config.kv_cache_dtype)
    if source.kv_scales is not None and (source.kv_scales_in_weights or float8_cache):
        from kiln.models.kv_scales import fold_kv_scales

        scales = [(k, v) for k, v in source.kv_scales]  # pairs, also when read from JSON
        start = model.layer_start  # a pipeline stage holds layers start..start + len - 1
        scales = scales[start : start + len(model.layers)]
        fold_kv_scales(model, scales, into_weights=not source.kv_scales_in_weights)
    model.eval()
    clock.mark("after_s")
    tokenizer = source.tokenizer
    if source.tokenizer_future is not None:
        tokenizer = source.tokenizer_future.result()  # its error, if any, is the load's
        clock.mark("tokenizer_wait_s")  # what of the tokenizer's load the weights did not hide
    _fold_int8_kv_scales(engine_config, source, model, tokenizer)
    return LoadedModel(
        model,
        cfg,
        tokenizer,
        source.generation_defaults,
        source.description,
        time.perf_counter() - start,
        clock.phases,
    )


class _PhaseClock:
    """Seconds since the last mark, per named phase; on CUDA each mark waits for the device, so
    queued work is charged to the phase that queued it."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.last = time.perf_counter()
        self.phases: dict[str, float] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.phases[name] = round(now - self.last, 4)
        self.last = now
