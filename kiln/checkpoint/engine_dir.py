"""Read and verify an engine directory (what `kiln build` writes): its manifest, its files'
sizes and hashes, its fused kiln-named weights.

The on-disk contract lives here, beside the other readers: the manifest's file name and format
version, the weight index. Every way an engine directory can be wrong (another format version, a
GPU class it was not built for, a truncated or tampered file) is a one-line ModelLoadError naming
the file or both versions, raised before any tensor reaches the model (a weight shard's hash is
checked as the shard is read, in the same pass: shard_reader.py).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
import torch

from kiln.checkpoint.file_hash import hash_files
from kiln.checkpoint.shard_reader import ShardReader
from kiln.errors import ModelLoadError
from kiln.models.config import MAX_POSITIONS, ModelConfig

MANIFEST_FILE = "kiln_engine.json"
ENGINE_FORMAT_VERSION = 1
WEIGHT_INDEX_FILE = "weights.index.json"


@dataclass(frozen=True)
class EngineDir:
    """A verified engine directory: its manifest (as the JSON dict) and architecture config."""

    path: str
    manifest: dict[str, Any]
    config: ModelConfig

    @property
    def description(self) -> str:
        m = self.manifest
        return f"engine {self.path} ({m['dtype']}, quantization {m['quantization']})"


def is_engine_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST_FILE))


def current_gpu_class() -> str | None:
    """The CUDA device's name (e.g. "NVIDIA H200"), or None without one."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def open_engine_dir(path: str, verify_hashes: bool = True) -> EngineDir:
    """Read the manifest and check the format version, the GPU class and every file's size (and,
    with verify_hashes, the hash of every file but the weight shards, which
    iter_engine_weights checks as it reads them) against it."""
    manifest = read_manifest(path)
    version = manifest.get("format_version")
    if version != ENGINE_FORMAT_VERSION:
        raise ModelLoadError(
            f"{path} is an engine of format version {version}; this kiln reads version "
            f"{ENGINE_FORMAT_VERSION} (rebuild it with this kiln's `kiln build`)"
        )
    built_on, here = manifest.get("gpu_class"), current_gpu_class()
    if built_on is not None and built_on != here:
        raise ModelLoadError(
            f"{path} was built for {built_on} (its kernel choices are tuned to it); this machine "
            f"has {here or 'no GPU'}: rebuild it here"
        )
    verify_files(path, manifest["files"], verify_hashes)
    try:
        config = ModelConfig.from_hf_dict(manifest["architecture"])
    except ModelLoadError as e:
        raise ModelLoadError(f"{os.path.join(path, MANIFEST_FILE)}: {e}") from e
    return EngineDir(path, manifest, config)


def runtime_defaults(model: str | None) -> dict[str, Any]:
    """What an engine directory was built for that the runtime should take unless told
    otherwise: its KV cache dtype (when not "auto") and its max_model_len (when set). Empty for
    any other model."""
    if not model or not os.path.isdir(model) or not is_engine_dir(model):
        return {}
    manifest = read_manifest(model)
    if manifest["format_version"] != ENGINE_FORMAT_VERSION:
        return {}  # loading it says why
    defaults: dict[str, Any] = {}
    if manifest.get("kv_cache_dtype", "auto") != "auto":
        defaults["kv_cache_dtype"] = manifest["kv_cache_dtype"]
    if manifest.get("max_model_len") is not None:
        defaults["max_model_len"] = manifest["max_model_len"]
    return defaults


class _FileEntry(msgspec.Struct):
    size: Annotated[int, msgspec.Meta(ge=0)]
    blake2b: str


_SCHEME_PATTERN = (
    r"^(none|fp8|fp8-dynamic|int8-w8a8|fp8-block|int4-(g\d+|channel)(-sym)?"
    r"|(int8|fp8)-w8a16-(g\d+|channel))$"
)


class ManifestSchema(msgspec.Struct):
    """What loading reads of a manifest, typed: the one place its types are checked (the
    builder's EngineManifest records more, which loading ignores)."""

    format_version: int
    files: dict[str, _FileEntry]
    architecture: dict[str, Any]
    dtype: str
    # What kiln build makes: layers.quantization.QUANTIZATIONS, its INT4 groups (builder.int4)
    # and a pre-quantized INT4 / 8-bit checkpoint's own scheme (builder.prequantized).
    quantization: Annotated[str, msgspec.Meta(pattern=_SCHEME_PATTERN)]
    gpu_class: str | None = None
    tensor_parallel_size: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 1
    kv_cache_dtype: str = "auto"
    max_model_len: Annotated[int, msgspec.Meta(ge=1, le=MAX_POSITIONS)] | None = None
    input_scales: dict[str, float] | None = None
    kv_scales: list[list[float]] | None = None
    kv_scales_in_weights: bool = True
    kv_head_scales: list[list[list[float]]] | None = None
    lm_head_quantization: Literal["none", "fp8"] = "none"
    unquantized_layers: list[str] | None = None
    outlier_channels: dict[str, list[int]] | None = None


def read_manifest(path: str) -> dict[str, Any]:
    """The manifest as a dict, after ManifestSchema's checks and every file name's: a relative
    path inside the directory. Each failure is one ModelLoadError line."""
    file = os.path.join(path, MANIFEST_FILE)
    try:
        with open(file, encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelLoadError(f"{file} is not a readable engine manifest: {e}") from e
    for key in ("format_version", "files", "architecture", "dtype", "quantization"):
        if not isinstance(manifest, dict) or key not in manifest:
            raise ModelLoadError(f"{file} is not an engine manifest: it has no {key!r}")
    if manifest["format_version"] != ENGINE_FORMAT_VERSION:
        return manifest  # open_engine_dir names both versions
    try:
        msgspec.convert(manifest, ManifestSchema)
    except msgspec.ValidationError as e:
        raise ModelLoadError(f"{file} is not a valid engine manifest: {e}") from None
    for name in manifest["files"]:
        if not is_confined(name):
            raise ModelLoadError(
                f"{file} lists {name!r}: an engine's files are relative paths inside it"
            )
    return manifest


def is_confined(name: str) -> bool:
    """Whether manifest file name `name` is a plain relative path inside its directory."""
    parts = name.split("/")
    return (
        bool(name)
        and not os.path.isabs(name)
        and "\\" not in name
        and "\0" not in name
        and all(part not in ("", ".", "..") for part in parts)
    )


def verify_files(path: str, files: dict[str, dict[str, Any]], verify_hashes: bool) -> None:
    """Every file the manifest lists exists with its recorded size (and blake2b)."""
    paths = [os.path.join(path, name) for name in files]
    for name, file in zip(files, paths):
        if not os.path.isfile(file):
            raise ModelLoadError(f"engine file {file} is missing")
        size = os.path.getsize(file)
        if size != files[name]["size"]:
            raise ModelLoadError(
                f"engine file {file} has {size} bytes, the manifest says {files[name]['size']} "
                "(truncated or replaced: rebuild the engine)"
            )
    if not verify_hashes:
        return
    small = [(name, file) for name, file in zip(files, paths) if not is_weight_shard(name)]
    names, paths = [n for n, _ in small], [f for _, f in small]
    for name, file, digest in zip(names, paths, hash_files(paths, desc="verifying engine")):
        if digest.blake2b != files[name]["blake2b"]:
            raise ModelLoadError(
                f"engine file {file} does not match its hash in the manifest "
                "(corrupt or modified: rebuild the engine)"
            )


def rank_dir_name(rank: int, tp: int) -> str:
    """Where `kiln build -tp N` puts tensor rank `rank`'s weights, inside the engine."""
    return f"rank-{rank}-of-{tp}"


def is_weight_shard(name: str) -> bool:
    return name.endswith(".safetensors")


def iter_engine_weights(
    engine: EngineDir, path: str, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """(kiln parameter name, tensor on `device`) of every weight in `path` (the engine's folder or
    one rank's), shard by shard in index order, each shard checked against the manifest's hash
    as it is read."""
    index_file = os.path.join(path, WEIGHT_INDEX_FILE)
    try:
        with open(index_file, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{index_file} is not a readable weight index: {e}") from e
    files = [os.path.join(path, shard) for shard in dict.fromkeys(weight_map.values())]
    root = os.path.abspath(engine.path)
    manifest_files = engine.manifest["files"]
    expected = {os.path.join(root, n): entry["blake2b"] for n, entry in manifest_files.items()}
    missing = [f for f in files if os.path.abspath(f) not in expected]
    if missing:
        raise ModelLoadError(f"engine file {missing[0]} is not in the manifest")
    by_path = {f: expected[os.path.abspath(f)] for f in files}
    yield from ShardReader(device, by_path).tensors(files)
