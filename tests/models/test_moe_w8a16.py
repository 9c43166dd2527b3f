"""Mixture-of-experts checkpoints with 8-bit integer weights as llm-compressor 0.14 writes them
(tests/data/moe_fp8_checkpoints/make.py: its tiny Qwen3-MoE, a dense layer between sparse
ones, routers left out): W8A16 per channel (`pack-quantized` int8, four codes an int32 word,
stored + 128) and W8A8 INT8 (`int-quantized` int8 weights per channel, int8 activations per
token), whose experts kiln runs weight-only (kiln.layers.moe_w8a16). The oracle is
transformers' Qwen3-MoE in fp32 on the checkpoint dequantized here (code * scale, the packing
undone with shifts, not kiln's reader): greedy tokens equal over 32 new tokens, alone and
batched, prompts long enough that prefill runs the grouped path and decode the GEMVs. Also a
Mixtral and a model-dtype checkpoint under quantization="int8-w8a16-channel", rounded here as
kiln rounds its experts, W8A16 in groups of 128 (llm-compressor's W8A16 preset), and the
refusals (float8 or other groups; TP / EP: tests/layers/test_moe_quantized_parallel.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import LLM
from kiln.errors import ModelLoadError
from kiln.layers.moe_w8a16 import W8A16MoEMethod
from kiln.layers.quantization.w8a16 import quantize_groups
from kiln.models.moe_config import expert_scale_count
from kiln.runtime.config_plan import weight_bytes
from tests.models.family_checks import save_tiny_hf
from tests.models.test_moe_int4 import ARGS, MIXTRAL, PROMPTS, TOKENS, _tokens
from tests.models.test_qwen3 import hf_greedy_tokens

DATA = Path(__file__).parents[1] / "data" / "moe_fp8_checkpoints"


def _unpack(words: torch.Tensor) -> torch.Tensor:  # [rows, cols / 4] int32 -> [rows, cols]
    """compressed-tensors' 8-bit packing: code i of a row in byte i % 4 of word i // 4, + 128."""
    shifts = torch.arange(4) * 8
    unsigned = (words.long()[:, :, None] >> shifts) & 0xFF
    return unsigned.reshape(words.shape[0], -1) - 128


def _dequantized(data: Path, out: Path) -> Path:
    """`data`'s weights as code * scale in fp32, the rest widened, without quantization_config."""
    with safe_open(str(data / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    plain = {}
    for key, value in state.items():
        prefix = key.rsplit(".", 1)[0]
        if key.endswith(".weight_packed"):
            codes = _unpack(value).float()
            scale = state[f"{prefix}.weight_scale"].float()  # [rows, 1] or [rows, K / 128]
            scale = scale.repeat_interleave(codes.shape[1] // scale.shape[1], dim=1)
            plain[f"{prefix}.weight"] = codes * scale
        elif key.endswith(".weight") and value.dtype == torch.int8:
            plain[key] = value.float() * state[f"{prefix}.weight_scale"].float()
        elif value.is_floating_point() and not key.endswith("weight_scale"):
            plain[key] = value.float()
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"))
    config = json.loads((data / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    return out


def _int8_tokens(module: torch.nn.Module, args: tuple) -> tuple:
    """A forward pre-hook rounding a dense projection's input per token to int8, as W8A8's
    run time does (tests/checkpoint/test_eight_bit_checkpoints.py's oracle)."""
    x = args[0]
    scale = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    return (torch.round(x / scale).clamp(-127, 127) * scale,)


def _want(path: Path, w8a8: bool = False) -> list[list[int]]:
    """HF's tokens; `w8a8`: the dense projections' inputs rounded (the experts' stay: kiln
    runs W8A8 experts weight-only)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    rounded = 0
    for name, module in hf.named_modules():
        if w8a8 and isinstance(module, torch.nn.Linear) and name.endswith("_proj"):
            assert ".experts." not in name  # transformers' stacked experts are no Linear
            module.register_forward_pre_hook(_int8_tokens)
            rounded += 1
    assert rounded == (3 * 4 + 3 if w8a8 else 0)  # three layers' attention, layer 1's MLP
    return [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]


# name -> (kiln's scheme, the experts' w13 scale shape)
CHECKPOINTS = {"ct_w8a16": ("int8-w8a16-channel", (4, 512)),
               "ct_w8a16_g128": ("int8-w8a16-g128", (4, 512, 1)),
               "ct_w8a8_int8": ("int8-w8a8", (4, 512))}  # fmt: skip


@pytest.mark.parametrize("name", list(CHECKPOINTS))
def test_llm_compressors_int8_moe_checkpoint(tmp_path, name) -> None:
    want = _want(_dequantized(DATA / name, tmp_path / "dequantized"), name == "ct_w8a8_int8")
    llm = LLM(str(DATA / name), **ARGS)
    model = llm.engine.executor.runner.model
    experts = model.layers[2].mlp.experts
    assert isinstance(experts.method, W8A16MoEMethod)
    quantization, scale_shape = CHECKPOINTS[name]
    assert experts.w13_weight.dtype == torch.int8
    assert experts.w13_weight_scale.shape == scale_shape
    assert [_tokens(llm, [p])[0] for p in PROMPTS] == want
    assert _tokens(llm, PROMPTS) == want
    # The memory plan counts the experts as made: a byte a weight, an fp32 scale a row
    # (measured against the FP8 plan, whose dense projections it shares).
    made = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )
    cfg = model.config
    sparse = sum(cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    per_layer = 3 * cfg.num_experts * cfg.hidden_size * cfg.moe_intermediate_size
    fp8 = sparse * (per_layer + expert_scale_count(cfg, "fp8-dynamic") * 4)
    gap = weight_bytes(cfg, torch.float32, quantization) - weight_bytes(
        cfg, torch.float32, "fp8-dynamic"
    )
    assert gap == made - fp8


def test_a_wrong_expert_scale_changes_the_tokens(tmp_path) -> None:
    """The oracle's tokens move when one sparse layer's expert scales are off by 2x: the test
    above can fail."""
    want = _want(_dequantized(DATA / "ct_w8a16", tmp_path / "dequantized"))
    llm = LLM(str(DATA / "ct_w8a16"), **ARGS)
    experts = llm.engine.executor.runner.model.layers[2].mlp.experts
    experts.w13_weight_scale.mul_(2.0)
    assert _tokens(llm, PROMPTS) != want


def rounded_checkpoint(source: Path, dtype: torch.dtype, group: int, out: Path) -> Path:
    """`source` with every projection rounded to `dtype` per channel (group 0) or in groups, as
    the 8-bit weight-only methods round a 16-bit checkpoint at load: the oracle's weights."""
    with safe_open(str(source / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    for key, value in state.items():
        if key.endswith("_proj.weight") or ".experts." in key:
            codes, scales = quantize_groups(value, dtype, group)
            state[key] = codes.float() * scales.repeat_interleave(group or value.shape[1], 1)
    out.mkdir(exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text((source / "config.json").read_text())
    return out


@pytest.mark.parametrize(
    ("dtype", "group"), [(torch.int8, 0), (torch.float8_e4m3fn, 0), (torch.int8, 128)]
)
def test_model_dtype_mixtral_experts_round_to_8_bits_per_channel(tmp_path, dtype, group) -> None:
    """quantization="int8-w8a16-channel" (or "fp8-w8a16-channel") on a fp32 Mixtral (w1 / w2 /
    w3 names): every projection rounded per channel as it loads; the oracle runs the same
    rounding here."""
    source = tmp_path / "mixtral"
    save_tiny_hf(str(source), "mixtral", "MixtralForCausalLM", **MIXTRAL)
    want = _want(rounded_checkpoint(source, dtype, group, tmp_path / "rounded"))
    scheme = "int8" if dtype == torch.int8 else "fp8"
    llm = LLM(str(source), quantization=f"{scheme}-w8a16-{f'g{group}' if group else 'channel'}",
              **ARGS)  # fmt: skip
    experts = llm.engine.executor.runner.model.layers[1].mlp.experts
    assert isinstance(experts.method, W8A16MoEMethod)
    assert experts.w2_weight.dtype == dtype
    assert _tokens(llm, PROMPTS) == want


def test_dummy_int8_experts_generate(tmp_path) -> None:
    """quantization="int8-w8a16-channel" on dummy weights (the benchmarks'): drawn codes."""
    source = tmp_path / "mixtral"
    save_tiny_hf(str(source), "mixtral", "MixtralForCausalLM", **MIXTRAL)
    llm = LLM(str(source), load_format="dummy", quantization="int8-w8a16-channel", **ARGS)
    experts = llm.engine.executor.runner.model.layers[0].mlp.experts
    assert isinstance(experts.method, W8A16MoEMethod)
    assert experts.w13_weight.unique().numel() > 100  # drawn, not left at zero
    assert 0 < float(experts.w2_weight_scale.max()) < 1e-3  # each row's absmax / 127
    assert len(_tokens(llm, PROMPTS[:1])[0]) == TOKENS


@pytest.mark.parametrize(
    ("edit", "scheme"),
    [({"type": "float"}, "fp8-w8a16-g128"), ({"group_size": 64}, "int8-w8a16-g64")],
)
def test_float8_groups_or_other_groups_of_experts_are_refused_by_name(tmp_path, edit, scheme):
    path = tmp_path / "edited"
    shutil.copytree(DATA / "ct_w8a16_g128", path)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(edit)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=f"{scheme}.*mixture-of-experts"):
        LLM(str(path), **ARGS)


@pytest.mark.parametrize("quantization", ["int8-w8a16-channel", "int8-w8a16-g128", "int8-w8a8"])
def test_kiln_build_writes_int8_experts_that_load_as_rounded(tmp_path, quantization) -> None:
    """`kiln build --quantization ...` of a Mixtral (no accuracy check, no smoothing): the
    engine holds int8 experts and generates what the checkpoint rounded at load does."""
    from kiln.builder.build import BuildOptions, build_engine

    source = tmp_path / "mixtral"
    save_tiny_hf(str(source), "mixtral", "MixtralForCausalLM", **MIXTRAL)
    options = BuildOptions(quantization=quantization, accuracy_check=False, max_model_len=256)
    build_engine(str(source), str(tmp_path / "engine"), options, None)
    engine = LLM(str(tmp_path / "engine"), **ARGS)
    experts = engine.engine.executor.runner.model.layers[0].mlp.experts
    assert isinstance(experts.method, W8A16MoEMethod) and experts.w13_weight.dtype == torch.int8
    want = _tokens(LLM(str(source), quantization=quantization, **ARGS), PROMPTS)
    assert _tokens(engine, PROMPTS) == want
