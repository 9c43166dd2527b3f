"""FP8 checkpoints made by the real tools (tests/data/fp8_checkpoints/make.py: llm-compressor's
FP8_DYNAMIC, NVIDIA ModelOpt's FP8 with KV scales) load as kiln's FP8 W8A8: the float8 weights
and scales as written, the scheme the checkpoint declares, outputs close to the bf16 source they
were made from; what kiln cannot load is refused with what it is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln import LLM, SamplingParams
from kiln.errors import ModelLoadError
from kiln.layers.quantization.fp8 import Fp8LinearMethod

DATA = Path(__file__).parents[1] / "data" / "fp8_checkpoints"
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, ignore_eos=True)
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4)


@pytest.fixture(scope="module")
def source_llm() -> LLM:
    return LLM(str(DATA / "source"), **ARGS)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize(
    ("name", "scheme", "activation"),
    [("compressed_tensors", "fp8-dynamic", "dynamic"), ("modelopt", "fp8", "static")],
)
def test_a_prequantized_checkpoint_loads_its_own_weights_and_scheme(
    name, scheme, activation, source_llm
) -> None:
    llm = LLM(str(DATA / name), **ARGS)
    model = llm.engine.executor.runner.model
    assert scheme in llm.engine.executor.facts.description
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Fp8LinearMethod) and qkv.method.activation_scheme == activation
    written = _tensors(DATA / name)
    prefix = "model.layers.0.self_attn."
    q_rows = written[prefix + "q_proj.weight"].shape[0]
    # The checkpoint's float8 bytes, not a re-quantization of something else.
    assert torch.equal(qkv.weight[:q_rows].view(torch.uint8),
                       written[prefix + "q_proj.weight"].view(torch.uint8))  # fmt: skip
    want_scale = written[prefix + "q_proj.weight_scale"].float().reshape(-1).expand(q_rows)
    torch.testing.assert_close(qkv.weight_scale[:q_rows], want_scale)
    if activation == "static":  # q, k, v share their input: one scale, the largest of the three
        shards = [written[prefix + f"{p}_proj.input_scale"].item() for p in "qkv"]
        assert qkv.input_scale.item() == pytest.approx(max(shards))
    # Close to the bf16 source it was quantized from (random weights: near-uniform logits, so
    # compare log-probabilities of the source's own greedy tokens).
    want = source_llm.generate(PROMPTS, GREEDY)
    forced = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, want)]
    scored = llm.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=0))
    reference = source_llm.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=0))
    for got, ref in zip(scored, reference):
        g = torch.tensor([next(iter(d.values())).logprob for d in got.prompt_logprobs[1:]])
        r = torch.tensor([next(iter(d.values())).logprob for d in ref.prompt_logprobs[1:]])
        assert (g - r).abs().max() < 0.05, (g - r).abs().max()


def test_modelopt_kv_scales_fold_into_a_float8_cache_only(source_llm) -> None:
    """ModelOpt's k_scale / v_scale: a float8 cache stores k / k_scale (qkv's k rows carry
    1 / k_scale, the softmax scale k_scale); another cache leaves the model as written."""
    written = _tensors(DATA / "modelopt")
    k_scale = written["model.layers.0.self_attn.k_proj.k_scale"].item()
    plain = LLM(str(DATA / "modelopt"), **ARGS).engine.executor.runner.model
    llm = LLM(str(DATA / "modelopt"), kv_cache_dtype="fp8", **ARGS)
    folded = llm.engine.executor.runner.model
    attn, plain_attn = folded.layers[0].self_attn, plain.layers[0].self_attn
    assert attn.scale == pytest.approx(plain_attn.scale * k_scale)
    rows = slice(attn.q_size, attn.q_size + attn.kv_size)
    torch.testing.assert_close(
        attn.qkv_proj.weight_scale[rows], plain_attn.qkv_proj.weight_scale[rows] / k_scale
    )
    # Still the model: the source's greedy tokens score as the source scores them.
    want = source_llm.generate(PROMPTS, GREEDY)
    forced = [p + list(o.outputs[0].token_ids) for p, o in zip(PROMPTS, want)]
    one = SamplingParams(max_tokens=1, prompt_logprobs=0)
    for got, ref in zip(llm.generate(forced, one), source_llm.generate(forced, one)):
        g = torch.tensor([next(iter(d.values())).logprob for d in got.prompt_logprobs[1:]])
        r = torch.tensor([next(iter(d.values())).logprob for d in ref.prompt_logprobs[1:]])
        assert (g - r).abs().max() < 0.1, (g - r).abs().max()


def test_asking_for_another_scheme_than_the_checkpoint_holds_is_refused() -> None:
    with pytest.raises(ModelLoadError, match="holds 'fp8' weights"):
        LLM(str(DATA / "modelopt"), quantization="fp8-dynamic", **ARGS)


def _edited_copy(tmp_path: Path, name: str, edit) -> str:
    out = tmp_path / name
    shutil.copytree(DATA / name, out)
    file = out / ("hf_quant_config.json" if name == "modelopt" else "config.json")
    data = json.loads(file.read_text())
    edit(data)
    file.write_text(json.dumps(data))
    return str(out)


def _int4(c):
    c["quantization_config"]["config_groups"]["group_0"]["weights"].update(
        type="int", num_bits=4, strategy="group", group_size=128
    )


def _lm_head_quantized(c):
    c["quantization_config"]["ignore"] = []


def _w4a8(c):
    c["quantization"]["quant_algo"] = "W4A8_AWQ"


def _undeclared(c):
    del c["quantization_config"]


@pytest.mark.parametrize(
    ("name", "edit", "message"),
    [
        ("compressed_tensors", _int4, "int4/group weights"),
        ("compressed_tensors", _lm_head_quantized, "its lm_head is quantized"),
        ("modelopt", _w4a8, "quant_algo 'W4A8_AWQ' is not supported"),
        ("compressed_tensors", _undeclared, "has dtype F8_E4M3"),
    ],
    ids=["int4", "lm-head", "w4a8", "float8-undeclared"],
)
def test_what_kiln_cannot_load_is_a_clear_error(tmp_path, name, edit, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        LLM(_edited_copy(tmp_path, name, edit), **ARGS)
