"""INT4 W4A16 checkpoints as the tools write them (tests/data/int4_checkpoints/make.py:
llm-compressor's compressed-tensors pack-quantized, GPTQ's and AutoAWQ's layouts) load into
kiln's INT4 method and generate the same greedy tokens as the checkpoint dequantized exactly
(here, from each format's documented layout) into a plain transformers Llama in fp32."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import LLM, SamplingParams
from kiln.errors import ModelLoadError
from kiln.layers.quantization.int4 import Int4LinearMethod

DATA = Path(__file__).parents[1] / "data" / "int4_checkpoints"
PROMPTS = [[1, 5, 9, 33, 7, 100], [1, 200, 3, 17], [4, 4, 8, 15, 16, 23, 42]]
TOKENS = 32
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=4, dtype="float32")
CHECKPOINTS = [
    "ct_g128", "ct_g128_asym", "ct_channel", "gptq", "gptq_channel", "gptq_desc_act", "awq",
]  # fmt: skip
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def _nibbles(words: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[rows, cols] int32 -> [rows, 8 cols]: column 8j + order[i] from bits 4i of word j."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    out = torch.empty(w.shape[0], w.shape[1] * 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out[:, col::8] = (w >> (4 * i)) & 15
    return out


def _dequantize(name: str, t: dict[str, torch.Tensor], prefix: str, quant: dict) -> torch.Tensor:
    """The [out, in] fp32 weight of `prefix` as its format defines it."""
    if name.startswith("ct_"):  # codes and zero points stored + 8 (signed int4)
        q = _nibbles(t[f"{prefix}.weight_packed"]) - 8
        scale = t[f"{prefix}.weight_scale"].float()
        zp = torch.zeros_like(scale)
        if f"{prefix}.weight_zero_point" in t:  # packed along the output channels
            zp = (_nibbles(t[f"{prefix}.weight_zero_point"].t()).t() - 8).float()
        group = q.shape[1] // scale.shape[1]
        g = torch.arange(q.shape[1]) // group
        return (q.float() - zp[:, g]) * scale[:, g]
    scales = t[f"{prefix}.scales"].float()  # [groups, out]
    if name == "awq":
        codes = _nibbles(t[f"{prefix}.qweight"], AWQ_ORDER)  # [in, out]
        zeros = _nibbles(t[f"{prefix}.qzeros"], AWQ_ORDER)
        g = torch.arange(codes.shape[0]) // quant["group_size"]
    else:  # GPTQ v1: [in / 8, out] packed along the inputs; zeros stored - 1
        codes = _nibbles(t[f"{prefix}.qweight"].t()).t()
        zeros = _nibbles(t[f"{prefix}.qzeros"]) + 1
        g = t[f"{prefix}.g_idx"].long()
    return ((codes - zeros[g]).float() * scales[g]).t()


def _oracle(name: str, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import LlamaConfig, LlamaForCausalLM

    path = DATA / name
    config = json.loads((path / "config.json").read_text())
    quant = config.pop("quantization_config")
    tensors = _tensors(path)
    state = {}
    for key, value in tensors.items():
        if key.endswith(("weight_packed", "qweight")):
            prefix = key.rsplit(".", 1)[0]
            state[f"{prefix}.weight"] = _dequantize(name, tensors, prefix, quant)
        elif value.is_floating_point() and not key.endswith(("scale", "scales")):
            state[key] = value.float()
    model = LlamaForCausalLM(LlamaConfig(**config)).float().eval()
    model.load_state_dict(state, strict=True)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=TOKENS, do_sample=False,
                                 min_new_tokens=TOKENS, pad_token_id=0)  # fmt: skip
            out.append(ids[0, len(prompt) :].tolist())
    return out


def _kiln(path: Path | str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(path), **ARGS)
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy)]


@pytest.fixture(scope="module")
def oracle() -> dict[str, list[list[int]]]:
    return {}


def _want(oracle: dict, name: str) -> list[list[int]]:
    if name not in oracle:
        oracle[name] = _oracle(name, PROMPTS)
    return oracle[name]


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_int4_checkpoint_generates_the_dequantized_models_tokens(name, oracle) -> None:
    want = _want(oracle, name)
    llm = LLM(str(DATA / name), **ARGS)
    qkv = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Int4LinearMethod) and qkv.weight.dtype == torch.int32
    assert (qkv.input_order is not None) == (name == "gptq_desc_act")
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    alone = [list(llm.generate([p], greedy)[0].outputs[0].token_ids) for p in PROMPTS]
    batched = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
    assert alone == want
    assert batched == want


@pytest.mark.parametrize("name", ["gptq_desc_act", "awq", "ct_channel"])
def test_codes_relaid_for_the_sm90_kernel_generate_the_same_tokens(name, oracle, monkeypatch):
    """The sm_90 path's load (forced here on the CPU): each layer keeps only its codes re-laid
    (act-order's reordered ones), and the model generates the dequantized model's tokens."""
    from kiln.layers.quantization import int4

    monkeypatch.setattr(int4, "relays_codes", lambda device, k, group_size: True)
    llm = LLM(str(DATA / name), **ARGS)
    qkv = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert qkv.weight_mma is not None and qkv.weight.numel() == 0
    greedy = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)] == _want(
        oracle, name
    )


def _edited(tmp_path: Path, name: str, config_edit=None, tensor_edit=None) -> Path:
    path = tmp_path / name
    shutil.copytree(DATA / name, path)
    if config_edit is not None:
        config = json.loads((path / "config.json").read_text())
        config_edit(config["quantization_config"])
        (path / "config.json").write_text(json.dumps(config))
    if tensor_edit is not None:
        tensors = _tensors(path)
        tensor_edit(tensors)
        save_file(tensors, str(path / "model.safetensors"))
    return path


def test_a_wrong_zero_point_offset_changes_the_tokens(tmp_path, oracle) -> None:
    """Read as GPTQ v2 (zeros stored as they are), the v1 checkpoint's zeros are off by one."""
    path = _edited(tmp_path, "gptq_desc_act", lambda q: q.update(checkpoint_format="gptq_v2"))
    assert _kiln(path, PROMPTS) != _want(oracle, "gptq_desc_act")


def test_a_wrong_group_index_changes_the_tokens(tmp_path, oracle) -> None:
    """The act-order checkpoint with its g_idx replaced by input order (a valid grouping, not
    the one its codes were rounded with)."""

    def in_order(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if k.endswith("g_idx")]:
            tensors[key] = (torch.arange(tensors[key].numel()) // 64).to(torch.int32)

    path = _edited(tmp_path, "gptq_desc_act", tensor_edit=in_order)
    assert _kiln(path, PROMPTS) != _want(oracle, "gptq_desc_act")


def test_projections_with_different_input_orders_are_refused(tmp_path) -> None:
    def shuffle_k(tensors: dict[str, torch.Tensor]) -> None:
        key = "model.layers.0.self_attn.k_proj.g_idx"
        tensors[key] = tensors[key].flip(0).contiguous()

    path = _edited(tmp_path, "gptq_desc_act", tensor_edit=shuffle_k)
    with pytest.raises(ModelLoadError, match="g_idx"):
        LLM(str(path), **ARGS)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda q: q.update(bits=8), "8-bit"),
        (lambda q: q.update(version="gemv"), "GEMM"),
        (lambda q: q.update(zero_point=False), "zero points"),
    ],
)
def test_awq_variants_kiln_cannot_load_are_refused(tmp_path, edit, message) -> None:
    with pytest.raises(ModelLoadError, match=message):
        LLM(str(_edited(tmp_path, "awq", edit)), **ARGS)


def test_a_checkpoint_missing_its_scales_is_refused(tmp_path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.mlp.up_proj.scales"]

    with pytest.raises(ModelLoadError, match="weight_scales"):
        LLM(str(_edited(tmp_path, "awq", tensor_edit=drop)), **ARGS)


def test_dummy_weights_run_as_int4_and_unquantized_weights_are_refused(tmp_path) -> None:
    """quantization="int4-g128" is for benchmarks on dummy weights; a 16-bit checkpoint is not
    rounded to INT4 while loading."""
    llm = LLM(str(DATA / "gptq"), load_format="dummy", quantization="int4-g128", **ARGS)
    qkv = llm.engine.executor.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.method, Int4LinearMethod)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((DATA / "gptq" / "config.json").read_text())
    del config["quantization_config"]
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="does not quantize to INT4 while loading"):
        LLM(str(tmp_path), quantization="int4-g128", **ARGS)
