"""Triton's compiled kernels, carried in an engine directory so a first process need not compile.

A cold process on an H200 spent 4.8 s compiling Triton kernels in the memory profile's forward and
6.2 s more warming the CUDA graphs. `kiln build` on a GPU runs the engine once against an empty
Triton cache and keeps what it compiled under `triton_cache/` in the engine (capture); loading
copies those entries into the Triton cache this process will read (install), where they are hits,
when the key matches: the same GPU class and compute capability and the same Triton version.
Otherwise nothing is copied and the kernels compile as before. The files are listed in the manifest
with their hashes like every other engine file, so a changed cubin is a corrupt engine, never
loaded.

Triton's cache is a folder per kernel hash (its source, options, backend and Triton's own
version), so copying entries in can only add hits, never change a kernel. Its group files
(`__grp__*.json`) name their member files by absolute path: captured entries store them relative
to the cache's root and installing writes them back absolute, under the destination.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from importlib import metadata

logger = logging.getLogger("kiln")

CACHE_SUBDIR = "triton_cache"
KEY_FILE = "key.json"
_GROUP_PREFIX = "__grp__"


def kernel_cache_key() -> dict[str, str] | None:
    """What a compiled kernel depends on besides its source (which Triton hashes into each
    entry's name): the GPU and the Triton build. None without CUDA or Triton."""
    import torch

    if not torch.cuda.is_available():
        return None
    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None
    major, minor = torch.cuda.get_device_capability()
    return {
        "gpu_class": torch.cuda.get_device_name(),
        "compute_capability": f"{major}.{minor}",
        "triton": triton_version,
        "cuda": str(torch.version.cuda),
    }


def active_cache_dir() -> str:
    """The folder Triton reads its cache from in this process (as triton.knobs.cache.dir
    resolves it, without importing Triton)."""
    explicit = os.environ.get("TRITON_CACHE_DIR")
    if explicit:
        return explicit
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~/")
    return os.path.join(home, ".triton", "cache")


def capture(cache_dir: str, engine_dir: str, key: dict[str, str]) -> list[str]:
    """Copy Triton cache `cache_dir` (the entries one warm-up run compiled) into
    `engine_dir/triton_cache/` with `key`. Returns the files written, relative to engine_dir."""
    root = os.path.join(engine_dir, CACHE_SUBDIR)
    names = []
    for entry in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []:
        src_entry = os.path.join(cache_dir, entry)
        if not os.path.isdir(src_entry) or entry.startswith("tmp."):
            continue
        for file in sorted(os.listdir(src_entry)):
            src = os.path.join(src_entry, file)
            if not os.path.isfile(src) or file == "lock" or file.startswith("tmp."):
                continue
            dst = os.path.join(root, entry, file)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if file.startswith(_GROUP_PREFIX):
                _write_group(src, dst, cache_dir, relative=True)
            else:
                shutil.copyfile(src, dst)
            names.append(os.path.relpath(dst, engine_dir))
    if not names:
        return []
    with open(os.path.join(root, KEY_FILE), "w", encoding="utf-8") as f:
        json.dump(key, f, indent=2, sort_keys=True)
    return [*names, os.path.relpath(os.path.join(root, KEY_FILE), engine_dir)]


def install(engine_dir: str, key: dict[str, str] | None = None) -> int:
    """Copy the engine's captured entries into the active Triton cache when its key equals this
    process's (`key`; default kernel_cache_key()). Returns how many files were copied (0: none
    carried, another GPU or Triton, or all there). Entries already present are kept; each file
    lands atomically (ranks of one engine may install at once). The loader calls it only where
    EngineConfig.engine_kernel_cache allows."""
    root = os.path.join(engine_dir, CACHE_SUBDIR)
    key_file = os.path.join(root, KEY_FILE)
    if not os.path.isfile(key_file):
        return 0
    with open(key_file, encoding="utf-8") as f:
        built_for = json.load(f)
    here = kernel_cache_key() if key is None else key
    if built_for != here:
        logger.info(
            "engine kernels were compiled for %s; this process is %s: compiling", built_for, here
        )
        return 0
    dest_root = active_cache_dir()
    try:
        copied = _copy_entries(root, dest_root)
    except OSError as e:  # an unwritable cache costs the compiles it would have saved, no more
        logger.warning("engine kernels not installed into %s: %s", dest_root, e)
        return 0
    logger.info("engine kernels: %d cache files into %s", copied, dest_root)
    return copied


def _copy_entries(root: str, dest_root: str) -> int:
    copied = 0
    for entry in sorted(os.listdir(root)):
        src_entry = os.path.join(root, entry)
        if not os.path.isdir(src_entry):
            continue
        dest_entry = os.path.join(dest_root, entry)
        os.makedirs(dest_entry, exist_ok=True)
        # The group last: Triton looks its members up by it, so it must not name a missing one.
        files = sorted(os.listdir(src_entry))
        for file in sorted(files, key=lambda f: f.startswith(_GROUP_PREFIX)):
            dst = os.path.join(dest_entry, file)
            if os.path.exists(dst):
                continue
            tmp = f"{dst}.tmp.{os.getpid()}"
            if file.startswith(_GROUP_PREFIX):
                _write_group(os.path.join(src_entry, file), tmp, dest_root, relative=False)
            else:
                shutil.copyfile(os.path.join(src_entry, file), tmp)
            os.replace(tmp, dst)
            copied += 1
    return copied


def _write_group(src: str, dst: str, cache_root: str, relative: bool) -> None:
    """A group file's member paths made relative to `cache_root` (capture) or absolute under it
    (install)."""
    with open(src, encoding="utf-8") as f:
        group = json.load(f)
    children = group.get("child_paths") or {}
    if relative:
        rewritten = {c: os.path.relpath(p, cache_root) for c, p in children.items()}
    else:
        rewritten = {c: os.path.join(cache_root, p) for c, p in children.items()}
    with open(dst, "w", encoding="utf-8") as f:
        json.dump({**group, "child_paths": rewritten}, f)
