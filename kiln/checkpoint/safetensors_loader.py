"""Read a Hugging Face checkpoint directory: config.json, generation_config.json, *.safetensors.

Everything that can be wrong with the directory (missing files, a shard the index names but the
directory lacks, a truncated or corrupt file, non-float tensors) is reported when
`load_hf_checkpoint` is called, before any tensor is read, so a build fails fast and names the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype codes kiln loads as weights (integer-quantized checkpoints are not supported;
# float8 ones only when the checkpoint declares an FP8 scheme: kiln.checkpoint.prequantized).
FLOAT_DTYPES = ("F32", "F16", "BF16")
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "max_new_tokens")


def read_hf_config(path: str) -> dict[str, Any]:
    """config.json of an HF checkpoint directory, as a dict (its quantization_config included)."""
    if not os.path.isdir(path):
        raise ModelLoadError(f"checkpoint directory {path!r} does not exist")
    return _read_json(os.path.join(path, "config.json"), required=True)


def load_hf_checkpoint(
    path: str, allow_fp8: bool = False, allow_int: bool = False, allow_fp4: bool = False
) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """(config, lazy iterator of (hf_name, tensor)) for an HF checkpoint directory.

    Tensors keep the dtype stored in the file. eos ids are those of config.json followed by any
    extra ones generation_config.json names (chat models list their end-of-turn token there).
    float8 tensors only with allow_fp8 (a checkpoint that declares its FP8 scheme); int8 / int32 /
    int64 ones only with allow_int (one that declares an integer scheme: int4_formats.py,
    eight_bit_formats.py); uint8 codes and float8 scales only with allow_fp4
    (kiln.checkpoint.fp4_formats).
    """
    config_dict = read_hf_config(path)
    generation = _read_json(os.path.join(path, "generation_config.json"), required=False)
    config_dict = _merge_generation_ids(config_dict, generation)
    try:
        config = ModelConfig.from_hf_dict(config_dict)
    except ModelLoadError as e:
        raise ModelLoadError(f"{os.path.join(path, 'config.json')}: {e}") from e
    files = _weight_files(path)
    for file in files:
        ints = ("I8", "I32", "I64") if allow_int else ()
        fp8 = ("F8_E4M3",) if allow_fp8 or allow_fp4 else ()
        _check_file(file, FLOAT_DTYPES + fp8 + ints + (("U8",) if allow_fp4 else ()))
    return config, _iter_tensors(files)


def read_generation_config(path: str) -> dict[str, Any]:
    """The sampling defaults in `path`/generation_config.json ({} when the file is absent).

    Only the keys present among GENERATION_DEFAULT_KEYS are returned. Like vLLM, and unlike
    transformers' generate(), `do_sample` is ignored: the file's temperature is the default even
    when do_sample is false or missing.
    """
    generation = _read_json(os.path.join(path, "generation_config.json"), required=False)
    return {key: generation[key] for key in GENERATION_DEFAULT_KEYS if key in generation}


def _read_json(file: str, required: bool) -> dict[str, Any]:
    if not os.path.isfile(file):
        if required:
            raise ModelLoadError(f"{file} does not exist (is this a Hugging Face checkpoint?)")
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{file} is not readable JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{file} holds a {type(data).__name__}, expected a JSON object")
    return data


def _merge_generation_ids(config: dict[str, Any], generation: dict[str, Any]) -> dict[str, Any]:
    """config with generation_config's eos ids appended and its bos id filling a missing one."""
    merged = dict(config)
    eos_ids = _id_list(config.get("eos_token_id"))
    eos_ids += [i for i in _id_list(generation.get("eos_token_id")) if i not in eos_ids]
    merged["eos_token_id"] = eos_ids or None
    if merged.get("bos_token_id") is None:
        merged["bos_token_id"] = generation.get("bos_token_id")
    return merged


def _id_list(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def _weight_files(path: str) -> list[str]:
    """The safetensors files of the checkpoint, in index order, each checked to exist."""
    index_file = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index_file):
        weight_map = _read_json(index_file, required=True).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_file} has no 'weight_map'")
        # dict.fromkeys: the shards in first-mention order, each once.
        files = [os.path.join(path, name) for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not os.path.isfile(file):
                raise ModelLoadError(f"{index_file} names shard {file}, which does not exist")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    others = sorted(f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf")))
    hint = f"; found {others} (convert to safetensors, or pass a .gguf file)" if others else ""
    raise ModelLoadError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}{hint}")


def _check_file(file: str, dtypes: tuple[str, ...]) -> None:
    """Open the header (safetensors validates its length against the file) and check dtypes."""
    try:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                dtype = f.get_slice(name).get_dtype()
                if dtype not in dtypes:
                    raise ModelLoadError(
                        f"{file}: tensor {name!r} has dtype {dtype}; kiln loads "
                        f"{', '.join(dtypes)} tensors here (FP8 checkpoints declare their scheme "
                        "in config.json or hf_quant_config.json; other quantized formats are "
                        "unsupported)"
                    )
    except SafetensorError as e:
        raise ModelLoadError(f"{file} is truncated or not a safetensors file: {e}") from e


def _iter_tensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                    yield name, f.get_tensor(name)
        except SafetensorError as e:  # the file changed since _check_file
            raise ModelLoadError(f"{file} could not be read: {e}") from e
