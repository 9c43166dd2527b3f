"""Finds a model (embedded default, HF directory, GGUF file, preset, hub id), builds it on the
device in the chosen dtype and fills its weights."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from kiln.config import EngineConfig
from kiln.errors import ModelLoadError
from kiln.models.config import PRESETS, ModelConfig
from kiln.models.llama import LlamaForCausalLM

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelSource:
    """A model before it is built: its shape, where its weights come from, its tokenizer."""

    config: ModelConfig
    weights: Iterator[tuple[str, torch.Tensor]] | None  # None: dummy weights
    tokenizer: object | None
    generation_defaults: dict
    description: str


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer: object | None
    generation_defaults: dict
    description: str
    load_seconds: float


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


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type: the model's own, or float8 e4m3 ("fp8")."""
    if name == "auto":
        return model_dtype
    return torch.float8_e4m3fn  # "fp8" / "fp8_e4m3" (validated by EngineConfig)


def find_model_source(model: str | None, load_format: str) -> ModelSource:
    from kiln.checkpoint.default_model import default_model_path

    path = default_model_path() if model is None else os.path.expanduser(model)
    if load_format == "dummy":
        return _dummy_source(path)
    if path.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ModelLoadError(f"GGUF file not found: {path}")
        return _gguf_source(path)
    if os.path.isdir(path):
        return _hf_dir_source(path)
    if model in PRESETS:
        raise ModelLoadError(
            f"{model!r} is an architecture preset: it has no weights; pass load_format='dummy'"
        )
    return _hub_source(model)


def _gguf_source(path: str) -> ModelSource:
    from kiln.checkpoint.gguf_loader import GGUFModel

    gguf_model = GGUFModel(path)
    return ModelSource(
        gguf_model.config, gguf_model.tensors(), gguf_model.tokenizer(), {}, f"GGUF {path}"
    )


def _hf_dir_source(path: str) -> ModelSource:
    from kiln.checkpoint.safetensors_loader import load_hf_checkpoint, read_generation_config

    config, weights = load_hf_checkpoint(path)
    return ModelSource(
        config, weights, _load_tokenizer(path), read_generation_config(path), f"HF {path}"
    )


def _load_tokenizer(path: str) -> object | None:
    from transformers import AutoTokenizer

    has_tokenizer = any(
        os.path.exists(os.path.join(path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if not has_tokenizer:
        return None
    try:
        return AutoTokenizer.from_pretrained(path)
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
        return ModelSource(gguf_model.config, None, gguf_model.tokenizer(), {}, f"dummy {name}")
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


def load_model(
    engine_config: EngineConfig, device: torch.device, dtype: torch.dtype
) -> LoadedModel:
    start = time.perf_counter()
    source = find_model_source(engine_config.model, engine_config.load_format)
    cfg = source.config
    max_positions = engine_config.max_model_len or cfg.max_position_embeddings
    with torch.device(device):
        model = LlamaForCausalLM(cfg, max_positions).to(dtype)
    model.cos_sin_cache = model.cos_sin_cache.float()  # rotary tables stay fp32
    if source.weights is None:
        model.init_dummy_weights(engine_config.seed)
    else:
        model.load_weights(source.weights)
    model.eval()
    return LoadedModel(
        model,
        cfg,
        source.tokenizer,
        source.generation_defaults,
        source.description,
        time.perf_counter() - start,
    )
