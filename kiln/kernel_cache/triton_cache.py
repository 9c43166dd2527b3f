"""Triton's compiled kernels, carried in an engine directory so a first process need not compile.

A cold process on an H200 spent 4.8 s compiling Triton kernels in the memory profile's forward and
6.2 s more warming the CUDA graphs. `kiln build` on a GPU runs the engine once against an empty
Triton cache and keeps the device code it compiled under `triton_cache/` in the engine (capture).
Loading installs those entries, when the key matches (the same GPU class and compute capability,
Triton and CUDA), into a cache private to this process that Triton reads before its own (install,
overlay.py). Otherwise nothing is installed and the kernels compile as before.

An engine directory is shared like a checkpoint, so installing trusts nothing in it but what the
manifest lists and hashes: only files named `triton_cache/<entry>/<file>` with a device-code or
metadata suffix (never a host-side module: Triton builds its launchers and `cuda_utils` here, in
the user's own cache), each hashed again as it is copied, nothing at all without a key that
equals this process's (a missing key matches nothing), and a group file's members only where they
are files of the same entry installed beside it. The user's persistent Triton cache is never
written, so nothing installed outlives the process.

Triton's cache is a folder per kernel hash (its source, options, backend and Triton's own
version), so adding entries can only add hits, never change a kernel. Its group files
(`__grp__*.json`) name their member files by absolute path: captured entries store them relative
to the cache's root and installing writes them back absolute, under the private cache.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from importlib import metadata
from typing import Any

from kiln.checkpoint.file_hash import bytes_digest

logger = logging.getLogger("kiln")

CACHE_SUBDIR = "triton_cache"
KEY_FILE = "key.json"
KEY_FIELDS = ("gpu_class", "compute_capability", "triton", "cuda")
_GROUP_PREFIX = "__grp__"
# Device code and the metadata Triton reads beside it; never `.so` or C sources (host code).
DEVICE_SUFFIXES = (".cubin", ".ptx", ".ttir", ".ttgir", ".llir", ".json")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")

_private_dir: str | None = None


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


def is_device_file(file: str) -> bool:
    """A file name a carried entry may hold: plain, with a device-code or metadata suffix."""
    return bool(_NAME.fullmatch(file)) and file.endswith(DEVICE_SUFFIXES)


def capture(cache_dir: str, engine_dir: str, key: dict[str, str]) -> list[str]:
    """Copy the device code of Triton cache `cache_dir` (the entries one warm-up run compiled)
    into `engine_dir/triton_cache/` with `key`. Returns the files written, relative to
    engine_dir. Host-side modules (launchers, `cuda_utils`) stay behind: they build locally."""
    root = os.path.join(engine_dir, CACHE_SUBDIR)
    names = []
    for entry in sorted(os.listdir(cache_dir)) if os.path.isdir(cache_dir) else []:
        src_entry = os.path.join(cache_dir, entry)
        if not os.path.isdir(src_entry) or not _NAME.fullmatch(entry) or entry.startswith("tmp."):
            continue
        for file in sorted(os.listdir(src_entry)):
            src = os.path.join(src_entry, file)
            if not os.path.isfile(src) or not is_device_file(file):
                continue
            dst = os.path.join(root, entry, file)
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            if file.startswith(_GROUP_PREFIX):
                _write_group(src, dst, cache_dir)
            else:
                shutil.copyfile(src, dst)
            names.append(os.path.relpath(dst, engine_dir))
    if not names:
        return []
    with open(os.path.join(root, KEY_FILE), "w", encoding="utf-8") as f:
        json.dump(key, f, indent=2, sort_keys=True)
    return [*names, os.path.relpath(os.path.join(root, KEY_FILE), engine_dir)]


def install(
    engine_dir: str, files: Mapping[str, Mapping[str, Any]], key: dict[str, str] | None = None
) -> int:
    """Install the engine's carried kernels that its manifest `files` lists and hashes (name ->
    {"blake2b": ...}) into this process's private Triton cache, when the carried key equals this
    process's (`key`; default kernel_cache_key()). Returns how many files were installed (0: none
    carried, another GPU or Triton, no GPU, or nothing acceptable). The loader calls it only
    where EngineConfig.engine_kernel_cache allows."""
    here = kernel_cache_key() if key is None else key
    listed = {n: e for n, e in files.items() if n.startswith(CACHE_SUBDIR + "/")}
    if not listed or here is None:
        return 0
    key_name = f"{CACHE_SUBDIR}/{KEY_FILE}"
    key_bytes = _read_verified(engine_dir, key_name, listed)
    try:
        built_for = json.loads(key_bytes) if key_bytes is not None else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        built_for = None
    if not _is_key(built_for) or not _is_key(here) or built_for != here:
        logger.info(
            "engine kernels were compiled for %s; this process is %s: compiling", built_for, here
        )
        return 0
    entries: dict[str, dict[str, bytes]] = {}
    for name in sorted(listed):
        parts = name.split("/")
        if name == key_name:
            continue
        if len(parts) != 3 or not _NAME.fullmatch(parts[1]) or not is_device_file(parts[2]):
            logger.warning("engine kernel cache: %r is not device code; not installed", name)
            continue
        data = _read_verified(engine_dir, name, listed)
        if data is not None:
            entries.setdefault(parts[1], {})[parts[2]] = data
    if not entries:
        return 0
    try:
        copied = _write_entries(entries, private_cache_dir())
    except OSError as e:  # an unwritable temp folder costs the compiles it would have saved
        logger.warning("engine kernels not installed: %s", e)
        return 0
    _use_private_cache()
    logger.info("engine kernels: %d cache files into %s", copied, private_cache_dir())
    return copied


def private_cache_dir() -> str:
    """This process's folder of installed engine kernels (0700, removed at exit)."""
    global _private_dir
    if _private_dir is None:
        _private_dir = tempfile.mkdtemp(prefix="kiln-kernels-")
        atexit.register(shutil.rmtree, _private_dir, True)
    return _private_dir


def _use_private_cache() -> None:
    """Make Triton look up compiled kernels in the private cache before its own."""
    from triton import knobs

    from kiln.kernel_cache.overlay import EngineKernelCache

    EngineKernelCache.overlay_dir = private_cache_dir()
    knobs.cache.manager_class = EngineKernelCache


def _is_key(key: object) -> bool:
    return (
        isinstance(key, dict)
        and set(key) == set(KEY_FIELDS)
        and all(isinstance(v, str) and v for v in key.values())
    )


def _read_verified(
    engine_dir: str, name: str, listed: Mapping[str, Mapping[str, Any]]
) -> bytes | None:
    """`name`'s bytes when they hash to the manifest's digest (read once: what is checked is
    what is installed), else None (logged)."""
    expected = (
        listed.get(name, {}).get("blake2b") if isinstance(listed.get(name), Mapping) else None
    )
    try:
        with open(os.path.join(engine_dir, name), "rb") as f:
            data = f.read()
    except OSError as e:
        logger.warning("engine kernel cache: %s unreadable (%s); not installed", name, e)
        return None
    if expected is None or bytes_digest(data) != expected:
        logger.warning(
            "engine kernel cache: %s does not match its manifest hash; not installed", name
        )
        return None
    return data


def _write_entries(entries: dict[str, dict[str, bytes]], dest_root: str) -> int:
    copied = 0
    for entry, contents in entries.items():
        dest_entry = os.path.join(dest_root, entry)
        os.makedirs(dest_entry, exist_ok=True)
        # Members before their group: Triton looks them up by it, so it must not name a missing one.
        for file in sorted(contents, key=lambda f: f.startswith(_GROUP_PREFIX)):
            data = contents[file]
            if file.startswith(_GROUP_PREFIX):
                group = _installed_group(data, entry, contents, dest_root)
                if group is None:
                    logger.warning("engine kernel cache: group %s/%s not installed", entry, file)
                    continue
                data = group
            dst = os.path.join(dest_entry, file)
            tmp = f"{dst}.tmp.{os.getpid()}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, dst)
            copied += 1
    return copied


def _installed_group(
    data: bytes, entry: str, contents: Mapping[str, bytes], dest_root: str
) -> bytes | None:
    """A carried group file with its members made absolute under `dest_root`, or None unless
    every member is a non-group file of the same entry installed beside it."""
    try:
        group = json.loads(data)
        children = group["child_paths"]
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError, KeyError):
        return None
    if not isinstance(children, dict):
        return None
    rewritten = {}
    for child, rel in children.items():
        if not isinstance(rel, str) or rel.split("/")[:1] != [entry] or rel.count("/") != 1:
            return None
        file = rel.split("/")[1]
        if file not in contents or file.startswith(_GROUP_PREFIX):
            return None
        rewritten[child] = os.path.join(dest_root, entry, file)
    return json.dumps({**group, "child_paths": rewritten}).encode()


def _write_group(src: str, dst: str, cache_root: str) -> None:
    """A group file's member paths made relative to `cache_root` (capture)."""
    with open(src, encoding="utf-8") as f:
        group = json.load(f)
    children = group.get("child_paths") or {}
    rewritten = {c: os.path.relpath(p, cache_root) for c, p in children.items()}
    with open(dst, "w", encoding="utf-8") as f:
        json.dump({**group, "child_paths": rewritten}, f)
