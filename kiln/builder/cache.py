"""Content addressing: an engine's id is a hash of its source's bytes and its build options, so
the same inputs name the same engine, and a cache of engines keyed by that id returns a finished
one at once (CI caches engines named by model hash)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import kiln
from kiln.builder.manifest import EngineManifest
from kiln.checkpoint.engine_dir import ENGINE_FORMAT_VERSION, MANIFEST_FILE, read_manifest
from kiln.checkpoint.file_hash import hash_files
from kiln.errors import ModelLoadError

# The files of an HF directory that decide what the engine is (weights, shape, tokenizer, chat
# template, sampling defaults); READMEs and the like do not.
_HF_SOURCE_SUFFIXES = (".safetensors", ".json", ".model", ".jinja", ".txt", ".tiktoken")


def default_cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kiln", "engines")


def source_files(path: str) -> list[str]:
    """The files whose bytes identify a source: the GGUF file, or an HF directory's weights,
    configs and tokenizer files (sorted, so the hash does not depend on listing order)."""
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise ModelLoadError(f"model {path!r} is neither a GGUF file nor a directory")
    names = sorted(
        n
        for n in os.listdir(path)
        if n.endswith(_HF_SOURCE_SUFFIXES) and os.path.isfile(os.path.join(path, n))
    )
    if not names:
        raise ModelLoadError(f"{path} holds no checkpoint files")
    return [os.path.join(path, n) for n in names]


def source_hash(path: str) -> str:
    """blake2b over the source files' names (relative) and content digests."""
    files = source_files(path)
    root = hashlib.blake2b(digest_size=32)
    for file, digest in zip(files, hash_files(files, desc="hashing source")):
        name = os.path.basename(file) if os.path.isdir(path) else ""
        root.update(f"{name}\0{digest.size}\0{digest.blake2b}\n".encode())
    return root.hexdigest()


def engine_id(source_digest: str, options: dict[str, Any]) -> str:
    """The id of the engine these inputs build: also keyed by the format and kiln versions, since
    another kiln may write other bytes for the same inputs."""
    key = {
        "source": source_digest,
        "options": options,
        "format_version": ENGINE_FORMAT_VERSION,
        "kiln_version": kiln.__version__,
    }
    blob = json.dumps(key, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def existing_engine(directory: str, wanted_id: str) -> EngineManifest | None:
    """The manifest of the finished engine with id `wanted_id` in `directory`, else None. Sizes
    are checked (cheap); hashes are checked when the engine is loaded."""
    if not os.path.isfile(os.path.join(directory, MANIFEST_FILE)):
        return None
    try:
        raw = read_manifest(directory)
    except ModelLoadError:
        return None
    if raw.get("format_version") != ENGINE_FORMAT_VERSION or raw.get("engine_id") != wanted_id:
        return None
    for name, entry in raw["files"].items():
        file = os.path.join(directory, name)
        if not os.path.isfile(file) or os.path.getsize(file) != entry["size"]:
            return None
    try:
        return EngineManifest.read(directory)
    except TypeError:  # written by a kiln whose manifest had other fields: rebuild
        return None


def copy_engine(src: str, dst: str) -> None:
    """Copy an engine directory, hard-linking files where the file system allows (an engine is
    never modified in place, so sharing its bytes is safe). Written beside `dst` and renamed, so
    a half-copied engine is never seen under its name."""
    tmp = f"{dst}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)

    def link_or_copy(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    for name in os.listdir(src):
        s, d = os.path.join(src, name), os.path.join(tmp, name)
        if os.path.isdir(s):  # a `kiln build -tp N` engine's rank-R-of-N/ folders
            shutil.copytree(s, d, copy_function=link_or_copy)
        else:
            link_or_copy(s, d)
    publish(tmp, dst)


def publish(tmp: str, dst: str) -> None:
    """Move a finished engine directory into place, replacing any stale one."""
    if os.path.isdir(dst):
        shutil.rmtree(dst)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    os.replace(tmp, dst)
