"""gpt-oss's MXFP4 experts as OpenAI ships them (`*_blocks` / `*_scales` tensors, config
quantization_config quant_method "mxfp4"), on a tiny random gpt-oss whose experts this file
rounds to MXFP4 and packs in that layout: the dequantized values equal transformers' own
(convert_moe_packed_tensors) bit for bit; the float8 conversion keeps every one (a power-of-two
scale per output channel); transformers' dequantized model of the checkpoint and kiln's, exact
("dequantized") or in float8 experts (the default), give the same greedy tokens; attention,
which the checkpoint leaves unquantized, stays so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln import LLM
from kiln.checkpoint.fp4_formats import E2M1_VALUES, openai_mxfp4_tensors, read_fp4
from tests.models.family_checks import hf_tokens, tokens
from tests.models.test_gpt_oss import save_tiny_gpt_oss
from tests.models.test_qwen3 import ARGS, GREEDY, PROMPTS

# What gpt-oss's config.json says of its quantization (transformers' Mxfp4Config).
QUANTIZATION_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
    ],
}  # fmt: skip


def pack_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, out, in] fp32 -> (blocks uint8 [E, out, in / 32, 16], scales uint8 [E, out, in /
    32]): each group of 32 inputs an e8m0 exponent (its absmax within e2m1's 6) and e2m1 codes
    rounded to nearest, two a byte, the low nibble first."""
    e, out, cols = weight.shape
    groups = weight.reshape(e, out, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0**-100)
    exponent = torch.ceil(torch.log2(amax / 6.0))
    scaled = groups / torch.exp2(exponent)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES)
    index = (scaled.abs()[..., None] - magnitudes).abs().argmin(-1)
    codes = (index + 8 * (scaled < 0)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(the bf16 source's path, the MXFP4 checkpoint's path)."""
    return save_tiny_mxfp4(tmp_path_factory.mktemp("gpt_oss_mxfp4"))


def save_tiny_mxfp4(root: Path) -> tuple[str, str]:
    """The tiny gpt-oss in `root`/src and its experts rounded to MXFP4 and packed as OpenAI
    ships them in `root`/mxfp4: (the source's path, the MXFP4 checkpoint's path)."""
    source, path = root / "src", root / "mxfp4"
    save_tiny_gpt_oss(str(source))
    shutil.copytree(source, path)
    tensors = load_file(str(source / "model.safetensors"))
    packed = {}
    for name, tensor in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # HF's parameter is [E, in, out]; the checkpoint holds [E, out, in] packed.
            blocks, scales = pack_mxfp4(tensor.transpose(1, 2).contiguous())
            packed[f"{name}_blocks"], packed[f"{name}_scales"] = blocks, scales
        else:
            packed[name] = tensor
    (path / "model.safetensors").unlink()
    save_file(packed, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = QUANTIZATION_CONFIG
    (path / "config.json").write_text(json.dumps(config))
    return str(source), str(path)


def _packed(path: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def test_dequantization_is_transformers_bit_for_bit(mxfp4) -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, path = mxfp4
    scheme = read_fp4(path, json.loads((Path(path) / "config.json").read_text()))
    assert scheme is not None and (scheme.producer, scheme.format) == ("openai", "mxfp4")
    tensors = _packed(path)
    ours = dict(openai_mxfp4_tensors(iter(tensors.items()), fp8=False))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        blocks, scales = tensors[f"{name}_blocks"], tensors[f"{name}_scales"]
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert ours[name].shape == theirs.shape and ours[name].dtype == torch.float32
        assert torch.equal(ours[name], theirs)
        assert len(torch.unique(scales)) > 1  # the groups' exponents differ
    assert "model.layers.0.mlp.experts.gate_up_proj_bias" in ours  # the rest passes through


def test_float8_conversion_keeps_every_value(mxfp4) -> None:
    _, path = mxfp4
    tensors = _packed(path)
    exact = dict(openai_mxfp4_tensors(iter(tensors.items()), fp8=False))
    fp8 = dict(openai_mxfp4_tensors(iter(tensors.items()), fp8=True))
    for name in ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj"):
        codes, scale = fp8[name], fp8[f"{name}_scale"]
        assert codes.dtype == torch.float8_e4m3fn and scale.shape == (4, codes.shape[2])
        assert torch.equal(codes.float() * scale[:, None, :], exact[name])


def test_the_mxfp4_model_equals_transformers_dequantized(mxfp4) -> None:
    from transformers import AutoModelForCausalLM, Mxfp4Config

    source, path = mxfp4
    hf = AutoModelForCausalLM.from_pretrained(
        path, quantization_config=Mxfp4Config(dequantize=True), dtype=torch.float32,
        attn_implementation="eager",
    ).eval()  # fmt: skip
    want = hf_tokens(hf, PROMPTS)
    bf16_source = hf_tokens(
        AutoModelForCausalLM.from_pretrained(source, attn_implementation="eager").eval(), PROMPTS
    )
    assert bf16_source != want  # the rounding to MXFP4 changed the model: the test can fail
    exact = LLM(path, load_format="dequantized", max_num_batched_tokens=64, **ARGS)
    experts = exact.engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float32
    assert tokens(exact.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]
    fp8 = LLM(path, max_num_batched_tokens=64, **ARGS)
    model = fp8.engine.executor.runner.model
    experts = model.layers[1].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale.shape == (4, 64)
    assert model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float32  # as shipped
    assert tokens(fp8.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]


def test_an_engine_built_from_mxfp4_is_the_exact_model_in_float8(mxfp4, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    _, path = mxfp4
    out = str(tmp_path / "engine")
    build_engine(path, out, BuildOptions(dtype="float32", max_model_len=256), None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    model = engine.engine.executor.runner.model
    assert model.layers[0].mlp.experts.w2_weight.dtype == torch.float8_e4m3fn
    assert model.layers[0].self_attn.o_proj.weight.dtype == torch.float32
    direct = LLM(path, max_num_batched_tokens=64, **ARGS)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(direct.generate(PROMPTS, GREEDY))


def test_values_float8_cannot_keep_are_counted_and_logged(mxfp4, caplog) -> None:
    _, path = mxfp4
    tensors = _packed(path)
    name = "model.layers.0.mlp.experts.down_proj"
    with caplog.at_level("WARNING", logger="kiln"):
        dict(openai_mxfp4_tensors(iter(tensors.items()), fp8=True))
    assert "round in float8" not in caplog.text  # this checkpoint's rows convert exactly
    blocks = torch.full((1, 2, 2, 16), 0x22, dtype=torch.uint8)  # every code 1.0
    scales = torch.tensor([[[127, 127 - 20], [127, 127]]], dtype=torch.uint8)  # 2^0 and 2^-20
    parts = {f"{name}_blocks": blocks, f"{name}_scales": scales}
    with caplog.at_level("WARNING", logger="kiln"):
        out = dict(openai_mxfp4_tensors(iter(parts.items()), fp8=True))
    assert "32 of 128 MXFP4 values round in float8" in caplog.text  # row 0's 2^-20 group
    assert (out[name][0, 32:, 0].float() == 0).all()  # flushed below e4m3's least subnormal
