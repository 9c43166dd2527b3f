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

cache_module = pytest.importorskip("triton.runtime.cache")
FileCacheManager = cache_module.FileCacheManager
knobs = pytest.importorskip("triton").knobs

KEY = {"gpu_class": "NVIDIA H200", "compute_capability": "9.0", "triton": "3.6.0", "cuda": "12.8"}
ENTRY = "a" * 52  # Triton names an entry by its kernel's hash


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch) -> str:
    """A fresh private cache per test, and Triton's cache manager put back afterwards."""
    private = tmp_path / "private"
    private.mkdir()
    monkeypatch.setattr(triton_cache, "_private_dir", str(private))
    monkeypatch.setattr(knobs.cache, "manager_class", knobs.cache.manager_class)
    return str(private)


def _compiled(cache_dir: str, monkeypatch) -> dict[str, bytes]:
    """What a Triton compile leaves in `cache_dir`: files and a group naming them by path."""
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    manager = FileCacheManager(ENTRY)
    files = {"k.cubin": b"\x7fELF-cubin", "k.json": b'{"name": "k"}'}
    paths = {name: manager.put(data, name) for name, data in files.items()}
    manager.put_group("k.json", paths)
    return files


def _lookup(cache_dir: str, monkeypatch, entry: str = ENTRY) -> dict[str, bytes] | None:
    """Triton's own lookup at compile time, through whatever cache manager this process uses:
    the group and every file it names, or None (a miss)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", cache_dir)
    manager_class = knobs.cache.manager_class or FileCacheManager
    group = manager_class(entry).get_group("k.json")
    if group is None:
        return None
    return {name: open(path, "rb").read() for name, path in group.items()}


def _listed(engine: str, names: list[str]) -> dict[str, dict]:
    """Manifest entries for `names` (files of `engine`), as a build writes them."""
    digests = hash_files([os.path.join(engine, n) for n in names])
    return {n: {"size": d.size, "blake2b": d.blake2b} for n, d in zip(names, digests)}


@pytest.fixture
def carried(tmp_path, monkeypatch) -> tuple[str, dict[str, bytes], dict[str, dict]]:
    """An engine folder holding a captured cache and its manifest entries; the cache it came from
    is gone (the build's temporary one), so its absolute paths must have been rewritten."""
    source, engine = str(tmp_path / "warm"), str(tmp_path / "engine")
    files = _compiled(source, monkeypatch)
    os.makedirs(engine)
    names = capture(source, engine, KEY)
    assert f"{CACHE_SUBDIR}/key.json" in names and f"{CACHE_SUBDIR}/{ENTRY}/k.cubin" in names
    shutil.rmtree(source)
    return engine, files, _listed(engine, names)


def test_matching_key_makes_the_carried_kernels_triton_hits(carried, tmp_path, monkeypatch):
    engine, files, listed = carried
    user = str(tmp_path / "cache")
    assert _lookup(user, monkeypatch) is None  # cold: Triton would compile
    assert install(engine, listed, KEY) == 3  # two files and their group
    assert _lookup(user, monkeypatch) == files
    # The user's persistent cache is never written: a later process does not see them.
    assert not any(files for _, _, files in os.walk(user))
    monkeypatch.setattr(knobs.cache, "manager_class", None)
    assert _lookup(user, monkeypatch) is None


@pytest.mark.parametrize("field", ["gpu_class", "compute_capability", "triton"])
def test_another_gpu_or_triton_is_ignored(carried, tmp_path, monkeypatch, field):
    engine, _, listed = carried
    assert install(engine, listed, {**KEY, field: "other"}) == 0
    assert _lookup(str(tmp_path / "cache"), monkeypatch) is None


def test_a_null_key_never_matches(carried, tmp_path, monkeypatch):
    engine, _, listed = carried
    monkeypatch.setattr(triton_cache, "kernel_cache_key", lambda: None)  # no CUDA here
    assert install(engine, listed) == 0
    key_file = os.path.join(engine, CACHE_SUBDIR, "key.json")
    with open(key_file, "w") as f:
        json.dump(None, f)
    listed = {**listed, **_listed(engine, [f"{CACHE_SUBDIR}/key.json"])}
    assert install(engine, listed) == 0
    assert install(engine, listed, KEY) == 0  # a null carried key matches no process either
    assert _lookup(str(tmp_path / "cache"), monkeypatch) is None


def test_only_listed_device_code_is_installed(carried, tmp_path, monkeypatch, private_cache):
    # The attack, made small: files added to a shared engine's triton_cache/ (unlisted, or
    # listed with their hashes but host-side modules) must never reach a Triton cache.
    engine, _, listed = carried
    other = "b" * 52
    os.makedirs(os.path.join(engine, CACHE_SUBDIR, other))
    planted = {
        f"{CACHE_SUBDIR}/{other}/cuda_utils.so": b"\x7fELF-native",
        f"{CACHE_SUBDIR}/{other}/__triton_launcher.c": b"int main;",
        f"{CACHE_SUBDIR}/{ENTRY}/extra.cubin": b"unlisted",
    }
    for name, data in planted.items():
        with open(os.path.join(engine, name), "wb") as f:
            f.write(data)
    listed = {**listed, **_listed(engine, [n for n in planted if "extra" not in n])}
    assert install(engine, listed, KEY) == 3
    installed = {
        os.path.relpath(os.path.join(d, f), private_cache)
        for d, _, fs in os.walk(private_cache)
        for f in fs
    }
    assert installed == {f"{ENTRY}/k.cubin", f"{ENTRY}/k.json", f"{ENTRY}/__grp__k.json"}
    # Triton's module builds go through the same manager: nothing of the engine is found there.
    assert knobs.cache.manager_class(other).get_file("cuda_utils.so") is None


@pytest.mark.parametrize("child", ["/etc/hostname", "../../x/k.cubin", "bbbb/k.cubin"])
def test_a_group_naming_files_outside_its_entry_is_not_installed(
    carried, tmp_path, monkeypatch, child
):
    engine, _, listed = carried
    group = os.path.join(engine, CACHE_SUBDIR, ENTRY, "__grp__k.json")
    with open(group, "w") as f:
        json.dump({"child_paths": {"k.cubin": child, "k.json": f"{ENTRY}/k.json"}}, f)
    listed = {**listed, **_listed(engine, [os.path.relpath(group, engine)])}
    assert install(engine, listed, KEY) == 2  # its members, never the group
    assert _lookup(str(tmp_path / "cache"), monkeypatch) is None


def test_a_file_changed_after_the_manifest_is_not_installed(carried, tmp_path, monkeypatch):
    engine, _, listed = carried
    with open(os.path.join(engine, CACHE_SUBDIR, ENTRY, "k.cubin"), "r+b") as f:
        f.write(b"\x00")
    assert install(engine, listed, KEY) == 1  # k.json; the group names a file it lacks
    assert _lookup(str(tmp_path / "cache"), monkeypatch) is None


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
    manifest["files"].update(_listed(copy, names))
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
    monkeypatch.setattr(knobs.cache, "manager_class", None)  # as a fresh process starts
    (tmp_path / "private2").mkdir()
    monkeypatch.setattr(triton_cache, "_private_dir", str(tmp_path / "private2"))
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


def test_an_unwritable_private_cache_only_costs_the_compiles(carried, tmp_path, monkeypatch):
    engine, _, listed = carried
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setattr(triton_cache, "_private_dir", str(blocker / "cache"))
    assert install(engine, listed, KEY) == 0
