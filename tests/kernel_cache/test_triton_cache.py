"""The engine's carried Triton kernels (kiln.kernel_cache): captured from a Triton cache, they are
Triton cache hits after loading when the GPU and Triton match, and ignored when they do not.
CPU only: Triton's own FileCacheManager stands in for a compile (what a GPU run would look up)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from kiln.builder.build import BuildOptions, build_engine
from kiln.checkpoint.engine_dir import MANIFEST_FILE
from kiln.checkpoint.file_hash import hash_files
from kiln.config import EngineConfig
from kiln.errors import ModelLoadError
from kiln.kernel_cache import triton_cache
from kiln.kernel_cache.triton_cache import CACHE_SUBDIR, capture, install
from kiln.runtime.model_loader import find_model_source, load_model
from tests.conftest import build_tiny_hf_model

FileCacheManager = pytest.importorskip("triton.runtime.cache").FileCacheManager

KEY = {"gpu_class": "NVIDIA H200", "compute_capability": "9.0", "triton": "3.6.0", "cuda": "12.8"}
ENTRY = "a" * 52  # Triton names an entry by its kernel's hash


def _compiled(cache_dir: str, monkeypatch) -> dict[str, bytes]:
    """What a Triton compile leaves in `cache_dir`: files and a group naming them by path."""
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    manager = FileCacheManager(ENTRY)
    files = {"k.cubin": b"\x7fELF-cubin", "k.json": b'{"name": "k"}'}
    paths = {name: manager.put(data, name) for name, data in files.items()}
    manager.put_group("k.json", paths)
    return files


def _lookup(cache_dir: str, monkeypatch) -> dict[str, bytes] | None:
    """Triton's own lookup at compile time: the group and every file it names, or None (a miss)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    group = FileCacheManager(ENTRY).get_group("k.json")
    if group is None:
        return None
    return {name: open(path, "rb").read() for name, path in group.items()}


@pytest.fixture
def carried(tmp_path, monkeypatch) -> tuple[str, dict[str, bytes]]:
    """An engine folder holding a captured cache; the cache it came from is gone (the build's
    temporary one), so its absolute paths must have been rewritten."""
    source, engine = str(tmp_path / "warm"), str(tmp_path / "engine")
    files = _compiled(source, monkeypatch)
    os.makedirs(engine)
    names = capture(source, engine, KEY)
    assert f"{CACHE_SUBDIR}/key.json" in names and f"{CACHE_SUBDIR}/{ENTRY}/k.cubin" in names
    shutil.rmtree(source)
    return engine, files


def test_matching_key_makes_the_carried_kernels_triton_hits(carried, tmp_path, monkeypatch):
    engine, files = carried
    dest = str(tmp_path / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", dest)
    assert _lookup(dest, monkeypatch) is None  # cold: Triton would compile
    monkeypatch.setenv("TRITON_CACHE_DIR", dest)
    assert install(engine, KEY) == 3  # two files and their group
    assert _lookup(dest, monkeypatch) == files
    monkeypatch.setenv("TRITON_CACHE_DIR", dest)
    assert install(engine, KEY) == 0  # already there: kept, nothing copied again


@pytest.mark.parametrize("field", ["gpu_class", "compute_capability", "triton"])
def test_another_gpu_or_triton_is_ignored(carried, tmp_path, monkeypatch, field):
    engine, _ = carried
    dest = str(tmp_path / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", dest)
    assert install(engine, {**KEY, field: "other"}) == 0
    assert _lookup(dest, monkeypatch) is None


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> str:
    src = str(tmp_path_factory.mktemp("src") / "llama")
    out = str(tmp_path_factory.mktemp("engine") / "e")
    build_tiny_hf_model("llama-gqa", src)
    build_engine(src, out, BuildOptions(), None)
    return out


def _with_kernels(engine: str, tmp_path, monkeypatch) -> str:
    """A copy of `engine` carrying captured kernels, listed in its manifest as a GPU build does."""
    copy = str(tmp_path / "with_kernels")
    shutil.copytree(engine, copy)
    source = str(tmp_path / "warm")
    _compiled(source, monkeypatch)
    names = capture(source, copy, KEY)
    with open(os.path.join(copy, MANIFEST_FILE)) as f:
        manifest = json.load(f)
    digests = hash_files([os.path.join(copy, n) for n in names])
    manifest["files"].update(
        {n: {"size": d.size, "blake2b": d.blake2b} for n, d in zip(names, digests)}
    )
    with open(os.path.join(copy, MANIFEST_FILE), "w") as f:
        json.dump(manifest, f)
    return copy


def test_loading_an_engine_installs_its_kernels_before_any_compile(
    tiny_engine, tmp_path, monkeypatch
):
    engine = _with_kernels(tiny_engine, tmp_path, monkeypatch)
    dest = str(tmp_path / "cache")
    monkeypatch.setattr(triton_cache, "kernel_cache_key", lambda: KEY)  # "this GPU"
    monkeypatch.setenv("TRITON_CACHE_DIR", dest)
    source = find_model_source(engine, "auto", engine_kernels=True)
    assert _lookup(dest, monkeypatch) is not None  # before the weights are even read
    assert sum(1 for _ in source.weights) > 0
    monkeypatch.setattr(triton_cache, "kernel_cache_key", lambda: {**KEY, "gpu_class": "other"})
    other = str(tmp_path / "other")
    monkeypatch.setenv("TRITON_CACHE_DIR", other)
    find_model_source(engine, "auto", engine_kernels=True)
    assert _lookup(other, monkeypatch) is None


def test_the_engine_config_may_refuse_the_carried_kernels(tiny_engine, tmp_path, monkeypatch):
    # They are native code from the engine directory: EngineConfig.engine_kernel_cache=False
    # loads the engine without installing them; the default installs them.
    engine = _with_kernels(tiny_engine, tmp_path, monkeypatch)
    monkeypatch.setattr(triton_cache, "kernel_cache_key", lambda: KEY)
    for enabled in (False, True):
        config = EngineConfig(model=engine, engine_kernel_cache=enabled)
        dest = str(tmp_path / f"cache-{enabled}")
        monkeypatch.setenv("TRITON_CACHE_DIR", dest)
        load_model(config, torch.device("cpu"), torch.float32)
        assert (_lookup(dest, monkeypatch) is not None) is enabled
    assert EngineConfig().engine_kernel_cache  # the default


def test_a_changed_carried_kernel_is_a_corrupt_engine(tiny_engine, tmp_path, monkeypatch):
    engine = _with_kernels(tiny_engine, tmp_path, monkeypatch)
    cubin = os.path.join(engine, CACHE_SUBDIR, ENTRY, "k.cubin")
    with open(cubin, "r+b") as f:
        f.write(b"\x00")  # same size, other bytes
    monkeypatch.setattr(triton_cache, "kernel_cache_key", lambda: KEY)
    dest = str(tmp_path / "cache")
    monkeypatch.setenv("TRITON_CACHE_DIR", dest)
    with pytest.raises(ModelLoadError, match="does not match its hash"):
        find_model_source(engine, "auto", engine_kernels=True)
    assert _lookup(dest, monkeypatch) is None  # nothing of it was installed


def test_the_build_warm_up_runs_an_engine(tiny_engine, tmp_path):
    # The child `kiln build` starts on a GPU to compile the kernels; here it only has to run.
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "c"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.builder.warm", tiny_engine, "auto", "0"],
        env=env, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_an_unwritable_triton_cache_only_costs_the_compiles(carried, tmp_path, monkeypatch):
    engine, _ = carried
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "cache"))  # makedirs fails under a file
    assert install(engine, KEY) == 0
