"""Mixture-of-experts checkpoints in INT4 (W4A16) as the tools write them: a tiny Qwen3-MoE made
with transformers, every projection (the experts' too; the routers left out, as GPTQModel,
AutoAWQ and llm-compressor leave them) quantized here to each format as it is defined - GPTQ
(v1 `checkpoint_format` "gptq": qweight [in / 8, out], qzeros [groups, out / 8] holding zero
- 1, scales, g_idx; group 128, desc_act off), AutoAWQ GEMM (qweight / qzeros [.., out / 8] in
AWQ's interleaved order, group 64, zero points) and compressed-tensors pack-quantized
(weight_packed [out, in / 8] of signed codes + 8, weight_scale, weight_zero_point packed along
the outputs, weight_shape) - with the dense INT4 tests' rounding and packing
(tests/data/int4_checkpoints/make.py). The oracle is transformers' Qwen3-MoE in fp32 on the
checkpoint dequantized exactly: greedy tokens equal over 32 new tokens, alone and batched,
prompts long enough that prefill runs the grouped path and decode the GEMVs."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln import LLM, SamplingParams
from kiln.errors import ModelLoadError
from kiln.layers.moe_int4 import Int4MoEMethod
from kiln.models.moe_config import expert_scale_count
from kiln.runtime.config_plan import weight_bytes
from tests.models.family_checks import save_tiny_hf
from tests.models.test_qwen3 import hf_greedy_tokens

TOKENS = 32
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
ARGS = dict(dtype="float32", block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=4, device="cpu")
# The first two longer than a decode step's 16 tokens: their prefill takes the grouped path.
PROMPTS = [[1, *range(40, 60)], [1, *range(100, 125)], [1, 5, 9, 33, 7]]
# Every projection 128 inputs wide: one group of 128.
QWEN3_MOE = dict(hidden_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                 num_hidden_layers=2, norm_topk_prob=True, head_dim=32, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256)  # fmt: skip
MIXTRAL = dict(hidden_size=128, intermediate_size=128, num_local_experts=4,
               num_experts_per_tok=2, num_hidden_layers=2, head_dim=32, num_attention_heads=4,
               num_key_value_heads=2)  # fmt: skip
QWEN2_MOE = dict(QWEN3_MOE, shared_expert_intermediate_size=128)
QWEN2_MOE.pop("head_dim")
# format -> (group size, symmetric)
FORMATS = {"gptq": (128, True), "awq": (64, False), "ct": (128, True), "ct_asym": (32, False),
           "gptq_g32": (32, False)}  # fmt: skip
# Per output channel (group 0: one group of every input; tests/distributed's TP / EP tests).
CHANNEL_FORMATS = {"gptq_channel": (0, False), "ct_channel": (0, True)}


def _make() -> ModuleType:
    """The dense INT4 checkpoints' rounding and packing (rtn, pack, AWQ_ORDER)."""
    path = Path(__file__).parents[1] / "data" / "int4_checkpoints" / "make.py"
    spec = importlib.util.spec_from_file_location("int4_make", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quantize(fmt: str, name: str, w: torch.Tensor, desc_act: bool = False):
    """`name`'s tensors in `fmt` and the weight they dequantize to, exactly."""
    make = _make()
    group, sym = {**FORMATS, **CHANNEL_FORMATS}[fmt]
    prefix = name.removesuffix(".weight")
    k = w.shape[1]
    g_idx = torch.arange(k) // (group or k)
    if desc_act:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(2))]
    codes, scales, zeros = make.rtn(w.float(), sym, g_idx)
    dequantized = (codes - zeros[:, g_idx]).float() * scales[:, g_idx]
    if fmt.startswith("gptq"):
        tensors = {
            "qweight": make.pack(codes).t().contiguous(),
            "qzeros": make.pack((zeros - 1).t().contiguous()),
            "scales": scales.t().contiguous().half(),
            "g_idx": g_idx.to(torch.int32),
        }
    elif fmt == "awq":
        tensors = {
            "qweight": make.pack(codes.t().contiguous(), make.AWQ_ORDER),
            "qzeros": make.pack(zeros.t().contiguous(), make.AWQ_ORDER),
            "scales": scales.t().contiguous().half(),
        }
    else:  # signed codes - 8 stored + 8: the unsigned codes as they are
        tensors = {
            "weight_packed": make.pack(codes),
            "weight_scale": scales.half(),
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int64),
        }
        if not sym:  # zero points packed along the outputs: [out / 8, groups]
            tensors["weight_zero_point"] = make.pack(zeros.t().contiguous()).t().contiguous()
    return {f"{prefix}.{kind}": t for kind, t in tensors.items()}, dequantized


def _config(fmt: str, desc_act: bool) -> dict:
    group, sym = {**FORMATS, **CHANNEL_FORMATS}[fmt]
    if fmt.startswith("gptq"):
        return dict(quant_method="gptq", bits=4, group_size=group or -1, sym=sym,
                    desc_act=desc_act, checkpoint_format="gptq", true_sequential=True,
                    damp_percent=0.01)  # fmt: skip
    if fmt == "awq":
        return dict(quant_method="awq", bits=4, group_size=group, zero_point=True, version="gemm",
                    modules_to_not_convert=None)  # fmt: skip
    weights = dict(num_bits=4, type="int", symmetric=sym, strategy="group" if group else "channel",
                   group_size=group or None, dynamic=False, actorder=None,
                   observer="minmax")  # fmt: skip
    return dict(
        quant_method="compressed-tensors", format="pack-quantized",
        config_groups={"group_0": dict(targets=["Linear"], weights=weights,
                                       input_activations=None, output_activations=None)},
        ignore=["lm_head", "re:.*mlp.gate$"], quantization_status="compressed",
    )  # fmt: skip


def write_int4(src: Path, dst: Path, fmt: str, desc_act: bool = False) -> Path:
    """`src` in `fmt` at `dst`; its exact dequantization at `dst`-dequantized (returned)."""
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    quantized, dequantized = {}, {}
    for name, tensor in state.items():
        if name.endswith("_proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", name):
            tensors, dequantized[name] = _quantize(fmt, name, tensor, desc_act)
            quantized.update(tensors)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((src / "config.json").read_text())
    plain = dst.with_name(f"{dst.name}-dequantized")
    for out, tensors, declared in ((dst, quantized, True), (plain, dequantized, False)):
        shutil.copytree(src, out)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        written = {**config, "quantization_config": _config(fmt, desc_act)} if declared else config
        (out / "config.json").write_text(json.dumps(written))
    return plain


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("qwen3_moe") / "fp32"
    save_tiny_hf(str(path), "qwen3_moe", "Qwen3MoeForCausalLM", **QWEN3_MOE)
    return path


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY)]


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int4_moe_checkpoint_generates_the_dequantized_models_tokens(source, tmp_path, fmt):
    from transformers import AutoModelForCausalLM

    plain = write_int4(source, tmp_path / fmt, fmt)
    hf = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    want = [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]
    llm = LLM(str(tmp_path / fmt), **ARGS)
    experts = llm.engine.executor.runner.model.layers[0].mlp.experts
    assert isinstance(experts.method, Int4MoEMethod)
    assert experts.w13_weight.dtype == torch.int32 and experts.w13_weight.shape == (4, 256, 16)
    assert [_tokens(llm, [p])[0] for p in PROMPTS] == want
    assert _tokens(llm, PROMPTS) == want
    # The memory plan counts the experts as made: half a byte a weight, fp32 scales and zeros
    # (measured against the FP8 plan, whose dense projections it shares).
    model = llm.engine.executor.runner.model
    made = sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n
    )
    group, sym = FORMATS[fmt]
    quantization = f"int4-g{group}" + ("-sym" if sym and fmt.startswith("ct") else "")
    cfg = model.config
    fp8 = 2 * (3 * 4 * 128 * 128 + expert_scale_count(cfg, "fp8-dynamic") * 4)
    gap = weight_bytes(cfg, torch.float32, quantization) - weight_bytes(
        cfg, torch.float32, "fp8-dynamic"
    )
    assert gap == made - fp8


def test_mixtral_int4_experts_load_by_their_w1_w2_w3_names(tmp_path) -> None:
    """AutoAWQ's Mixtral releases: block_sparse_moe.experts.E.w1 / w2 / w3."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "mixtral"
    save_tiny_hf(str(source), "mixtral", "MixtralForCausalLM", **MIXTRAL)
    plain = write_int4(source, tmp_path / "awq", "awq")
    hf = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    want = [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]
    llm = LLM(str(tmp_path / "awq"), **ARGS)
    experts = llm.engine.executor.runner.model.layers[1].mlp.experts
    assert isinstance(experts.method, Int4MoEMethod)
    assert _tokens(llm, PROMPTS) == want


def test_qwen2_moe_int4_experts_beside_an_int4_shared_expert(tmp_path) -> None:
    """Qwen2-MoE: its shared expert a dense INT4 MLP, its gate left in the model dtype."""
    from transformers import AutoModelForCausalLM

    source = tmp_path / "qwen2_moe"
    save_tiny_hf(str(source), "qwen2_moe", "Qwen2MoeForCausalLM", **QWEN2_MOE)
    plain = write_int4(source, tmp_path / "ct_asym", "ct_asym")
    hf = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    want = [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]
    llm = LLM(str(tmp_path / "ct_asym"), **ARGS)
    mlp = llm.engine.executor.runner.model.layers[0].mlp
    assert isinstance(mlp.experts.method, Int4MoEMethod)
    assert mlp.shared_expert.down_proj.weight.dtype == torch.int32
    assert _tokens(llm, PROMPTS) == want


def test_a_wrong_expert_zero_point_changes_the_tokens(source, tmp_path):
    """The GPTQ v1 checkpoint read as v2: every zero point, the experts' too, off by one."""
    from transformers import AutoModelForCausalLM

    plain = write_int4(source, tmp_path / "gptq", "gptq")
    hf = AutoModelForCausalLM.from_pretrained(str(plain), dtype=torch.float32).eval()
    want = [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]
    path = tmp_path / "gptq"
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["checkpoint_format"] = "gptq_v2"  # zeros read as stored
    (path / "config.json").write_text(json.dumps(config))
    assert _tokens(LLM(str(path), **ARGS), PROMPTS) != want


def test_act_order_experts_are_refused(source, tmp_path):
    write_int4(source, tmp_path / "gptq", "gptq_g32", desc_act=True)
    with pytest.raises(ModelLoadError, match="desc_act"):
        LLM(str(tmp_path / "gptq"), **ARGS)


def test_dummy_int4_experts_run_at_their_dummy_scales(source) -> None:
    """quantization="int4-g128" on dummy weights (the benchmarks'): random codes at the dense
    INT4's dummy scale, zeros 8, so the experts' weights span about +-0.02."""
    llm = LLM(str(source), load_format="dummy", quantization="int4-g128", **ARGS)
    experts = llm.engine.executor.runner.model.layers[0].mlp.experts
    assert isinstance(experts.method, Int4MoEMethod)
    assert experts.w13_weight.unique().numel() > 100  # drawn, not left at zero
    assert torch.all(experts.w13_weight_scales == experts.w13_weight_scales.flatten()[0])
    assert torch.all(experts.w2_weight_zeros == 8)
    assert len(_tokens(llm, PROMPTS[:1])[0]) == TOKENS


def test_kiln_build_int4_refuses_a_mixture_of_experts_by_name(source, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine
    from kiln.errors import BuildError

    options = BuildOptions(quantization="int4-gptq", accuracy_check=False, max_model_len=256)
    with pytest.raises(BuildError, match="mixture-of-experts experts to INT4"):
        build_engine(str(source), str(tmp_path / "engine"), options, None)


def test_llm_compressors_own_w4a16_moe_checkpoint(tmp_path) -> None:
    """llm-compressor 0.14's `oneshot` W4A16 on a tiny Qwen3-MoE (routers left out, a dense layer
    between sparse ones: tests/data/moe_fp8_checkpoints/make.py), dequantized here as the
    dense INT4 tests read compressed-tensors' layout (checked there against compressed-tensors'
    own dequantize)."""
    from transformers import AutoModelForCausalLM

    from tests.checkpoint.test_int4_checkpoints import _dequantize

    data = Path(__file__).parents[1] / "data" / "moe_fp8_checkpoints" / "ct_w4a16"
    with safe_open(str(data / "model.safetensors"), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    plain = {}
    for key, value in state.items():
        if key.endswith("weight_packed"):
            prefix = key.removesuffix(".weight_packed")
            plain[f"{prefix}.weight"] = _dequantize("ct_w4a16", state, prefix, {})
        elif value.is_floating_point() and not key.endswith("weight_scale"):
            plain[key] = value.float()
    out = tmp_path / "dequantized"
    out.mkdir()
    save_file(plain, str(out / "model.safetensors"))
    config = json.loads((data / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps({**config, "dtype": "float32"}))
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    want = [hf_greedy_tokens(hf, p)[:TOKENS] for p in PROMPTS]
    llm = LLM(str(data), **ARGS)
    experts = llm.engine.executor.runner.model.layers[2].mlp.experts
    assert isinstance(experts.method, Int4MoEMethod) and not experts.method.needs_zeros
    assert _tokens(llm, PROMPTS) == want
