"""`kiln build` from an FP4 checkpoint (tests/data/fp4_checkpoints: llm-compressor's NVFP4A16 and
MXFP4A16): "auto" makes the FP8 engine loading the checkpoint runs (the same float8 bytes), its
accuracy check scores it against the exact FP4 model, and a build that asks for other weights
("none") gets the exact values."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln import LLM
from kiln.builder.build import BuildOptions, build_engine
from kiln.builder.manifest import EngineManifest
from tests.tiny_tokenizer import build_tokenizer

DATA = Path(__file__).parents[1] / "data" / "fp4_checkpoints"
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4)


def _with_tokenizer(name: str, tmp_path: Path) -> str:
    """A copy of the test checkpoint with a tokenizer: a build scores and calibrates on text."""
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    build_tokenizer().save_pretrained(str(out))
    return str(out)


def _engine_tensors(engine: str) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(Path(engine).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return tensors


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4"])
def test_an_fp4_checkpoint_builds_the_fp8_engine_loading_it_runs(name, tmp_path) -> None:
    src = _with_tokenizer(name, tmp_path)
    engine = str(tmp_path / "engine")
    manifest = build_engine(src, engine, BuildOptions(), None)
    assert manifest.quantization == "fp8-dynamic"
    assert manifest.quantization_source is not None
    assert manifest.quantization_source["format"] == f"compressed-tensors {name}"
    # Checked against the exact FP4 model, within the small-model limit.
    accuracy = EngineManifest.read(engine).accuracy
    assert accuracy["checked"] and accuracy["passed"], accuracy
    assert 0 < abs(accuracy["word_perplexity_increase_pct"]) < 2.0, accuracy
    # The engine's float8 weights are the bytes loading the checkpoint converts to.
    direct = LLM(src, **ARGS).engine.executor.runner.model
    written = _engine_tensors(engine)
    qkv = direct.layers[1].self_attn.qkv_proj
    weight = written["layers.1.self_attn.qkv_proj.weight"]
    assert weight.dtype == torch.float8_e4m3fn
    assert torch.equal(weight.view(torch.uint8), qkv.weight.view(torch.uint8))
    assert torch.equal(written["layers.1.self_attn.qkv_proj.weight_scale"], qkv.weight_scale)


def test_an_unquantized_build_of_fp4_holds_the_exact_values(tmp_path) -> None:
    src = _with_tokenizer("nvfp4", tmp_path)
    engine = str(tmp_path / "engine")
    build_engine(src, engine, BuildOptions(quantization="none"), None)
    exact = LLM(src, load_format="dequantized", **ARGS).engine.executor.runner.model
    written = _engine_tensors(engine)
    assert torch.equal(
        written["layers.0.mlp.down_proj.weight"], exact.layers[0].mlp.down_proj.weight
    )


@pytest.mark.parametrize(
    ("name", "target", "scale"),
    [("mxfp4", "fp8-block", "weight_scales"), ("nvfp4", "int8-w8a16-g16", "weight_scales")],
)
def test_an_fp4_build_to_another_conversion_writes_loadings_bytes(
    name, target, scale, tmp_path
) -> None:
    """`--quantization fp8-block | int8-w8a16-g16` of an FP4 checkpoint makes the engine
    loading it with that quantization runs (the same codes and scales), checked against the
    exact FP4 model: MXFP4's blocks and NVFP4's int8 groups keep the values, so only the
    activations (fp8-block's, per group of 128) move the perplexity, and int8-w8a16-g16 not at
    all."""
    src = _with_tokenizer(name, tmp_path)
    engine = str(tmp_path / "engine")
    manifest = build_engine(src, engine, BuildOptions(quantization=target), None)
    assert manifest.quantization == target
    assert manifest.quantization_source is not None
    assert "converted as loading converts it" in manifest.quantization_source["method"]
    accuracy = EngineManifest.read(engine).accuracy
    assert accuracy["checked"] and accuracy["passed"], accuracy
    if target == "int8-w8a16-g16":
        assert accuracy["word_perplexity_increase_pct"] == 0.0, accuracy
    else:
        assert 0 < abs(accuracy["word_perplexity_increase_pct"]) < 2.0, accuracy
    direct = LLM(src, quantization=target, **ARGS).engine.executor.runner.model
    written = _engine_tensors(engine)
    gate_up = direct.layers[1].mlp.gate_up_proj
    weight = written["layers.1.mlp.gate_up_proj.weight"]
    assert weight.dtype == gate_up.weight.dtype
    assert torch.equal(weight.view(torch.uint8), gate_up.weight.view(torch.uint8))
    assert torch.equal(written[f"layers.1.mlp.gate_up_proj.{scale}"], gate_up.weight_scales)
