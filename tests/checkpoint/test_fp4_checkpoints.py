"""FP4 checkpoints (tests/data/fp4_checkpoints/make.py: llm-compressor's NVFP4A16 and MXFP4A16,
ModelOpt's NVFP4 layout) dequantize exactly as their producers' own code does, load converted to
FP8 per output channel, and run close to the exact FP4 model, which transformers runs in fp32
from the dequantized weights."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from kiln import LLM, SamplingParams
from kiln.checkpoint.fp4_formats import (
    CONVERSIONS,
    convert,
    dequantize,
    fp4_tensors,
    read_fp4,
    to_fp8,
)
from kiln.errors import ModelLoadError
from kiln.kernels.reference import quantize_fp8
from kiln.layers.quantization.fp8 import Fp8LinearMethod
from kiln.layers.quantization.fp8_block import Fp8BlockLinearMethod, quantize_blocks
from kiln.layers.quantization.w8a16 import W8A16LinearMethod

DATA = Path(__file__).parents[1] / "data" / "fp4_checkpoints"
NAMES = ["nvfp4", "mxfp4", "modelopt_nvfp4"]
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17]]
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
# The FP8 checkpoint tests' bound on forced tokens' log-probabilities (test_prequantized.py).
LOGPROB_TOLERANCE = 0.05


def _tensors(name: str) -> dict[str, torch.Tensor]:
    with safe_open(str(DATA / name / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _scheme(name: str):
    config = json.loads((DATA / name / "config.json").read_text())
    scheme = read_fp4(str(DATA / name), config)
    assert scheme is not None
    return scheme


def _projections(name: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each FP4 projection's parts, by prefix."""
    scheme = _scheme(name)
    tensors = _tensors(name)
    prefixes = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")}
    return {p: {part: tensors[f"{p}.{part}"] for part in scheme.parts} for p in sorted(prefixes)}


@pytest.mark.parametrize("name", NAMES)
def test_dequantization_is_the_producers_own_bit_for_bit(name) -> None:
    """Against compressed-tensors' unpack_fp4_from_uint8 + dequantize in fp32 (ModelOpt: scale
    times scale_2, as vLLM reads it), recorded by make.py."""
    want = load_file(str(DATA / f"{name}_dequantized.safetensors"))
    scheme = _scheme(name)
    projections = _projections(name)
    assert len(projections) == len(want) == 14
    for prefix, parts in projections.items():
        got = dequantize(scheme, parts, prefix)
        assert got.dtype == torch.float32
        assert torch.equal(got, want[f"{prefix}.weight"]), prefix


def test_mxfp4_dequantization_is_transformers_gpt_oss_reader_bit_for_bit() -> None:
    """transformers' own MXFP4 reader (gpt-oss's _blocks / _scales) reads the same values."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    scheme = _scheme("mxfp4")
    for prefix, parts in _projections("mxfp4").items():
        packed, scales = parts["weight_packed"], parts["weight_scale"]
        blocks = packed.reshape(packed.shape[0], -1, 16)  # [out, in / 32, 16]: gpt-oss's layout
        want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)
        assert torch.equal(dequantize(scheme, parts, prefix), want[0].t()), prefix


@pytest.mark.parametrize("name", NAMES)
def test_fp8_conversion_keeps_the_fp4_values(name) -> None:
    """MXFP4 converts exactly (power-of-two row scales); NVFP4 within 1.5% relative (the FP8
    scales aligned to its grid: half absmax / 448's error)."""
    scheme = _scheme(name)
    err = base = absmax_err = 0.0
    for prefix, parts in _projections(name).items():
        exact = dequantize(scheme, parts, prefix)
        codes, scale = to_fp8(scheme, parts, prefix)
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (exact.shape[0], 1)
        err += float((codes.float() * scale - exact).square().sum())
        q, s = quantize_fp8(exact, None)
        absmax_err += float((q.float() * s - exact).square().sum())
        base += float(exact.square().sum())
    relative, absmax_relative = (err / base) ** 0.5, (absmax_err / base) ** 0.5
    if scheme.format == "mxfp4":
        assert relative == 0.0
    else:
        assert relative < 0.015 and relative < 0.6 * absmax_relative, (relative, absmax_relative)


# (checkpoint, conversion): every one of CONVERSIONS but the per-channel default, tested above.
OTHER_CONVERSIONS = [
    (name, target)
    for name in NAMES
    for target in CONVERSIONS[_scheme(name).format]
    if target != "fp8-dynamic"
]


@pytest.mark.parametrize(("name", "target"), OTHER_CONVERSIONS)
def test_other_conversions_keep_the_fp4_values(name, target) -> None:
    """int8 in groups of 16 is exact for both formats, and so are MXFP4's float8 conversions
    (power-of-two scales: its test checkpoint's blocks span few binades); NVFP4's 128x128
    blocks keep its values within 1.5% relative, better than absmax / 448 blocks."""
    scheme = _scheme(name)
    err = base = absmax_err = 0.0
    for prefix, parts in _projections(name).items():
        exact = dequantize(scheme, parts, prefix)
        converted = convert(scheme, parts, exact, target)
        rows, cols = exact.shape
        if target == "fp8-block":
            assert converted.codes.dtype == torch.float8_e4m3fn
            assert converted.scales.shape == (-(-rows // 128), -(-cols // 128))
            q, s = quantize_blocks(exact)
            absmax_err += float(
                (q.float() * s.repeat_interleave(128, 1)[:, :cols] - exact).square().sum()
            )
        elif target == "int8-w8a16-g16":
            assert converted.codes.dtype == torch.int8 and converted.scales.shape == (
                rows,
                cols // 16,
            )
            assert int(converted.codes.abs().max()) <= 12
        else:
            assert converted.codes.dtype == torch.float8_e4m3fn and converted.scales.shape == (
                rows,
                1,
            )
        err += float((converted.values() - exact).square().sum())
        base += float(exact.square().sum())
    relative = (err / base) ** 0.5
    if target == "fp8-block" and scheme.format == "nvfp4":
        absmax_relative = (absmax_err / base) ** 0.5
        assert 0 < relative < 0.015 and relative < 0.9 * absmax_relative, (
            relative,
            absmax_relative,
        )
    else:
        assert relative == 0.0


def test_mxfp4_blocks_spanning_more_than_e4m3_round_and_are_counted() -> None:
    """An MXFP4 128x128 block keeps its values when its groups' exponents fit e4m3's range
    (largest / smallest code within 2^14); a block whose groups lie 2^20 apart rounds the small
    ones, which values() shows against the exact weight."""
    scheme = _scheme("mxfp4")
    packed = torch.full((128, 64), 0x72, dtype=torch.uint8)  # codes 1.0 and 6.0
    for spread, exact_expected in ((12, True), (20, False)):
        scales = torch.full((128, 4), 127, dtype=torch.uint8)
        scales[:, 0] = 127 - spread  # one group of each row far below the others
        parts = {"weight_packed": packed, "weight_scale": scales}
        exact = dequantize(scheme, parts)
        converted = convert(scheme, parts, exact, "fp8-block")
        assert torch.equal(converted.values(), exact) == exact_expected, spread


def test_a_loads_rounded_mxfp4_values_are_counted_in_a_warning(caplog) -> None:
    scales = torch.full((128, 4), 127, dtype=torch.uint8)
    scales[:, 0] = 107  # 2^20 below the rest of the block: its group underflows e4m3
    tensors = {
        "layers.0.mlp.down_proj.weight_packed": torch.full((128, 64), 0x72, dtype=torch.uint8),
        "layers.0.mlp.down_proj.weight_scale": scales,
    }
    with caplog.at_level("WARNING", logger="kiln"):
        out = dict(fp4_tensors(iter(tensors.items()), _scheme("mxfp4"), "fp8-block"))
    assert out["layers.0.mlp.down_proj.weight"].dtype == torch.float8_e4m3fn
    assert "mxfp4 -> fp8-block: 4096 of 16384 weights rounded" in caplog.text


def _hf_model(name: str):
    """transformers' Llama with the FP4 checkpoint's unquantized tensors and make.py's record
    of compressed-tensors' dequantization of the rest, in fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((DATA / name / "config.json").read_text())
    config.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    state = {k: v for k, v in _tensors(name).items() if v.dtype not in (torch.uint8,)}
    state = {k: v.float() for k, v in state.items() if not k.endswith(("_scale", "_scale_2"))}
    state.update(load_file(str(DATA / f"{name}_dequantized.safetensors")))
    model.load_state_dict(state, strict=True)
    return model


def _hf_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], torch.Tensor]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False)
        logprobs = torch.log_softmax(model(out).logits[0].float(), -1)
    tokens = out[0, len(prompt) :].tolist()
    return tokens, logprobs[len(prompt) - 1 : -1].gather(1, out[0, len(prompt) :, None])[:, 0]


@pytest.mark.parametrize("name", NAMES)
def test_fp8_engine_runs_close_to_the_exact_fp4_model_in_transformers(name) -> None:
    """The dequantized engine is transformers' FP4 model, token for token; the FP8 engine
    scores transformers' greedy tokens within the FP8 tests' log-probability tolerance."""
    hf = _hf_model(name)
    exact = LLM(str(DATA / name), load_format="dequantized", **ARGS)
    fp8 = LLM(str(DATA / name), **ARGS)
    qkv = fp8.engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8LinearMethod) and qkv.weight.dtype == torch.float8_e4m3fn
    assert "-> fp8-dynamic" in fp8.engine.executor.facts.description
    one = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for prompt, got in zip(PROMPTS, exact.generate(PROMPTS, GREEDY)):
        tokens, hf_logprobs = _hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert list(got.outputs[0].token_ids) == tokens
        for llm, tolerance in ((exact, 1e-4), (fp8, LOGPROB_TOLERANCE)):
            (scored,) = llm.generate([prompt + tokens], one)
            generated = scored.prompt_logprobs[len(prompt) :]
            logprobs = [next(iter(d.values())).logprob for d in generated]
            diff = (torch.tensor(logprobs) - hf_logprobs).abs().max().item()
            assert diff < tolerance, (name, diff)
    exact.shutdown()
    fp8.shutdown()


@pytest.mark.parametrize(("name", "target"), [c for c in OTHER_CONVERSIONS if c[1] != "fp8-block"])
def test_weight_only_conversions_run_the_exact_fp4_model(name, target) -> None:
    """Weight-only conversions keep the FP4 values: the engine's greedy tokens are
    transformers' dequantized FP4 model's in fp32, its log-probabilities the dequantized
    engine's to 1e-4."""
    hf = _hf_model(name)
    llm = LLM(str(DATA / name), quantization=target, dtype="float32", **ARGS)
    down = llm.engine.executor.runner.model.layers[1].mlp.down_proj
    assert isinstance(down.method, W8A16LinearMethod)
    assert down.method.group_size == (16 if target == "int8-w8a16-g16" else 0)
    assert f"-> {target}" in llm.engine.executor.facts.description
    one = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for prompt, got in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        tokens, hf_logprobs = _hf_greedy(hf, prompt, GREEDY.max_tokens)
        assert list(got.outputs[0].token_ids) == tokens
        (scored,) = llm.generate([prompt + tokens], one)
        logprobs = [next(iter(d.values())).logprob for d in scored.prompt_logprobs[len(prompt) :]]
        assert (torch.tensor(logprobs) - hf_logprobs).abs().max().item() < 1e-4, name
    llm.shutdown()


@pytest.mark.parametrize("name", NAMES)
def test_fp8_block_conversion_loads_its_blocks_and_runs_close(name) -> None:
    """quantization="fp8-block" loads the 128x128 conversion (MXFP4: the exact values), and
    scores transformers' greedy tokens within the FP8 tests' tolerance."""
    hf = _hf_model(name)
    llm = LLM(str(DATA / name), quantization="fp8-block", dtype="float32", **ARGS)
    qkv = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8BlockLinearMethod)
    assert qkv.weight.dtype == torch.float8_e4m3fn
    hf_qkv = torch.cat([getattr(hf.model.layers[0].self_attn, f"{p}_proj").weight for p in "qkv"])
    loaded = qkv.weight.float() * qkv.weight_scales.repeat_interleave(128, 1)[:, : qkv.in_features]
    if _scheme(name).format == "mxfp4":
        assert torch.equal(loaded, hf_qkv)
    else:
        assert 0 < (loaded - hf_qkv).norm() / hf_qkv.norm() < 0.015
    one = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for prompt in PROMPTS:
        tokens, hf_logprobs = _hf_greedy(hf, prompt, GREEDY.max_tokens)
        (scored,) = llm.generate([prompt + tokens], one)
        logprobs = [next(iter(d.values())).logprob for d in scored.prompt_logprobs[len(prompt) :]]
        assert (torch.tensor(logprobs) - hf_logprobs).abs().max().item() < LOGPROB_TOLERANCE
    llm.shutdown()


@pytest.mark.parametrize(
    ("name", "target", "message"),
    [
        ("nvfp4", "fp8-w8a16-channel", "float8 codes per channel round NVFP4's"),
        ("modelopt_nvfp4", "int8-w8a16-channel", "int8 scales per channel or per 128"),
        ("mxfp4", "int8-w8a16-g128", "int8 scales per channel or per 128"),
        ("mxfp4", "int8-w8a8", "int8 scales per channel or per 128"),
    ],
)
def test_conversions_that_would_round_the_fp4_values_are_refused(name, target, message) -> None:
    with pytest.raises(ModelLoadError, match=rf"cannot load as quantization='{target}'.*{message}"):
        LLM(str(DATA / name), quantization=target, **ARGS)


def _edited_copy(tmp_path: Path, name: str, edit) -> str:
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    file = out / ("hf_quant_config.json" if name.startswith("modelopt") else "config.json")
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))
    return str(out)


def _group_32(c):
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"] = 32


def _asymmetric(c):
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False


def _lm_head_quantized(c):
    c["quantization"]["exclude_modules"] = []


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("nvfp4", _group_32, "nvfp4-pack-quantized with 1 groups of float4/g32"),
        ("mxfp4", _asymmetric, "symmetric fp4 weights"),
        ("modelopt_nvfp4", _lm_head_quantized, "its lm_head is quantized"),
    ],
    ids=["nvfp4-group", "asymmetric", "lm-head"],
)
def test_what_kiln_cannot_read_is_a_clear_error(tmp_path, name, edit, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        LLM(_edited_copy(tmp_path, name, edit), **ARGS)


def test_a_projection_missing_a_part_is_named(tmp_path) -> None:
    out = tmp_path / "nvfp4"
    shutil.copytree(DATA / "nvfp4", out)
    tensors = _tensors("nvfp4")
    del tensors["model.layers.1.mlp.down_proj.weight_global_scale"]
    from safetensors.torch import save_file

    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.mlp\.down_proj lacks"):
        LLM(str(out), **ARGS)


def test_dequantized_is_refused_for_other_quantized_checkpoints() -> None:
    fp8 = Path(__file__).parents[1] / "data" / "fp8_checkpoints" / "compressed_tensors"
    with pytest.raises(ModelLoadError, match="load_format 'dequantized' widens FP4"):
        LLM(str(fp8), load_format="dequantized", **ARGS)
