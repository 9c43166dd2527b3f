"""An engine manifest is read through one schema: names confined to the directory, every type
checked, sizes sane, and each failure one ModelLoadError line (issue 57: `../../../../etc/passwd`
was stat'ed and hashed, the error printing its size; a list of files, a max_model_len of 1e12 or
an unknown quantization gave 34-40-line tracebacks)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import typing

import pytest

from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.options import QUANTIZATIONS as BUILD_QUANTIZATIONS
from kiln.checkpoint.engine_dir import MANIFEST_FILE, ManifestSchema, open_engine_dir
from kiln.errors import ModelLoadError
from kiln.layers.quantization import QUANTIZATIONS
from kiln.runtime.model_loader import find_model_source
from tests.conftest import build_tiny_hf_model


@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory) -> str:
    src = str(tmp_path_factory.mktemp("src") / "llama")
    out = str(tmp_path_factory.mktemp("engine") / "e")
    build_tiny_hf_model("llama-gqa", src)
    build_engine(src, out, BuildOptions(), None)
    return out


def _tampered(engine: str, tmp_path, change) -> str:
    copy = str(tmp_path / "copy")
    shutil.copytree(engine, copy)
    path = os.path.join(copy, MANIFEST_FILE)
    with open(path) as f:
        manifest = json.load(f)
    change(manifest)
    with open(path, "w") as f:
        json.dump(manifest, f)
    return copy


def _add_file(name: str):
    def change(manifest: dict) -> None:
        manifest["files"][name] = {"size": 1, "blake2b": "0" * 64}

    return change


def _set(key: str, value: object):
    return lambda manifest: manifest.__setitem__(key, value)


CASES = {
    "dot-dot": (_add_file("../../../../etc/passwd"), "relative paths inside it"),
    "absolute": (_add_file("/etc/hostname"), "relative paths inside it"),
    "files as a list": (
        lambda m: m.__setitem__("files", list(m["files"])),
        "Expected `object`, got `array` - at `$.files`",
    ),
    "max_model_len 1e12": (_set("max_model_len", 10**12), "$.max_model_len"),
    "unknown quantization": (_set("quantization", "int4"), "$.quantization"),
    "tp as text": (_set("tensor_parallel_size", "2"), "$.tensor_parallel_size"),
    "negative size": (
        lambda m: next(iter(m["files"].values())).__setitem__("size", -1),
        "$.files",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_manifest_is_one_line_naming_the_field(tiny_engine, tmp_path, case):
    change, named = CASES[case]
    engine = _tampered(tiny_engine, tmp_path, change)
    with pytest.raises(ModelLoadError) as err:
        find_model_source(engine, "auto")
    message = str(err.value)
    assert named in message and "\n" not in message
    assert "bytes" not in message  # nothing about a file outside the engine


def test_the_schema_knows_every_quantization_a_build_writes():
    from kiln.builder.int4 import INT4_BUILDS

    annotation = typing.get_type_hints(ManifestSchema, include_extras=True)["quantization"]
    pattern = typing.get_args(annotation)[1].pattern
    built = set(BUILD_QUANTIZATIONS) - {"auto"}  # "auto" resolves before the manifest is written
    int4_groups = {"int4-g128", "int4-g64", "int4-g32"}  # what an INT4 build's manifest names
    # A pre-quantized INT4 / 8-bit checkpoint's own scheme (kiln.builder.prequantized).
    checkpoints = {"int4-channel", "int4-g128-sym", "int4-channel-sym", "int8-w8a16-g64",
                   "fp8-w8a16-g32", "fp8-w8a16-channel"}  # fmt: skip
    for name in built - set(INT4_BUILDS) | int4_groups | checkpoints | set(QUANTIZATIONS):
        assert re.fullmatch(pattern, name), name
    for name in (*INT4_BUILDS, "auto", "int4", "int4-g", "int8-w8a16", "nvfp4", "fp8 "):
        assert not re.fullmatch(pattern, name), name


def test_a_good_engine_still_opens(tiny_engine):
    assert open_engine_dir(tiny_engine).manifest["quantization"] == "none"


def test_kiln_generate_says_it_in_one_line_and_exits_2(tiny_engine, tmp_path):
    engine = _tampered(tiny_engine, tmp_path, _set("quantization", "int4"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "kiln.cli.main", "generate", "--model", engine, "hi"],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "$.quantization" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
