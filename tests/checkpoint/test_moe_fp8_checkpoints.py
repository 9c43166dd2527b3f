"""Mixture-of-experts FP8 checkpoints as llm-compressor writes them
(tests/data/moe_fp8_checkpoints/make.py: a tiny Qwen3-MoE, bf16, `oneshot` with the routers
left out): FP8_BLOCK (every projection and expert in 128x128 blocks) loads into block-scaled
experts, FP8_DYNAMIC (float8 per channel, activations per token) into per-channel float8
experts, each against transformers on the checkpoint dequantized here from the
compressed-tensors layout (code x its scale), inputs rounded as kiln's run time rounds them
(tests/models/test_moe_fp8_block.check_against). An engine built from the per-channel one
keeps its experts per channel."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import LLM
from tests.models.test_moe_fp8_block import ARGS, PROMPTS, check_against, fp8_tokens, oracle

DATA = Path(__file__).parents[1] / "data" / "moe_fp8_checkpoints"


def _dequantized(name: str, tmp_path: Path) -> str:
    """The checkpoint copied with every float8 weight widened (code x its scale: one per
    128x128 block, or per output row) and no quantization_config; returns the copy's path
    without the "-dequantized" suffix oracle() adds."""
    with safe_open(str(DATA / name / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out = {}
    for key, value in state.items():
        if key.endswith("weight_scale"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            scale = state[f"{key}_scale"].float()
            rows, k = value.shape
            if scale.shape != (rows, 1):  # 128x128 blocks
                scale = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :k]
            value = value.float() * scale
        out[key] = value.float()
    path = tmp_path / name
    dequantized = Path(f"{path}-dequantized")
    dequantized.mkdir(parents=True)
    save_file(out, str(dequantized / "model.safetensors"))
    config = json.loads((DATA / name / "config.json").read_text())
    config.pop("quantization_config")
    config["dtype"] = "float32"
    (dequantized / "config.json").write_text(json.dumps(config))
    return str(path)


def test_fp8_block_experts_from_llm_compressor(tmp_path) -> None:
    llm = LLM(str(DATA / "ct_fp8_block"), **ARGS)
    experts = llm.engine.executor.runner.model.layers[0].mlp.experts
    assert type(experts.method).__name__ == "Fp8BlockMoEMethod"
    assert experts.w2_weight_scale.shape == (4, 128, 2)
    check_against(oracle(_dequantized("ct_fp8_block", tmp_path)), llm, PROMPTS)


@pytest.fixture(scope="module")
def dynamic(tmp_path_factory) -> tuple[torch.nn.Module, LLM]:
    path = _dequantized("ct_fp8_dynamic", tmp_path_factory.mktemp("dyn"))
    return oracle(path, rounding=fp8_tokens), LLM(str(DATA / "ct_fp8_dynamic"), **ARGS)


def test_per_channel_experts_from_llm_compressor(dynamic) -> None:
    model, llm = dynamic
    experts = llm.engine.executor.runner.model.layers[0].mlp.experts
    assert type(experts.method).__name__ == "Fp8MoEMethod" and experts.method.per_channel
    with safe_open(str(DATA / "ct_fp8_dynamic" / "model.safetensors"), framework="pt") as f:
        scale = f.get_tensor("model.layers.2.mlp.experts.3.down_proj.weight_scale")
    assert torch.equal(llm.engine.executor.runner.model.layers[2].mlp.experts.w2_weight_scale[3],
                       scale.float().reshape(-1))  # fmt: skip
    check_against(model, llm, PROMPTS)


def test_an_engine_built_from_it_keeps_per_channel_experts(dynamic, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    model, _ = dynamic
    out = str(tmp_path / "engine")
    options = BuildOptions(dtype="float32", accuracy_check=False, max_model_len=256)
    build_engine(str(DATA / "ct_fp8_dynamic"), out, options, None)
    assert json.loads((Path(out) / "config.json").read_text())["kiln_per_channel_experts"]
    built = LLM(out, **ARGS)
    assert built.engine.executor.runner.model.layers[0].mlp.experts.w13_weight_scale.dim() == 2
    check_against(model, built, PROMPTS[:1])
    shutil.rmtree(out)
