"""gpt-oss against Hugging Face in fp32 (eager attention) on a tiny random checkpoint: attention
sinks, q/k/v/o biases, alternating 8-token windows (every prompt but one is longer, and all
grow past it), yarn rope, a biased router, experts with biases (away from transformers' zero
init) and the clamped SwiGLU (a limit the activations cross). Greedy tokens equal over 32 new
tokens alone, batched, chunked, prefix-cached and preempted; float8 experts (a scale per
output channel) within float8's noise; the memory plan counting every expert, bias and sink;
the real presets' sizes. Under TP and EP: tests/distributed/test_gpt_oss_parallel.py."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.models.config import PRESETS, ModelConfig
from kiln.runtime.config_plan import weight_bytes
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_gpu,
    check_preempted,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
    tokens,
)
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS

WINDOW = 8
# A consistent yarn (factor = max_position_embeddings / original), as gpt-oss's own config.
YARN = {
    "rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
    "original_max_position_embeddings": 64, "rope_theta": 150000.0,
}  # fmt: skip
TINY_GPT_OSS = dict(
    num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, head_dim=32,
    sliding_window=WINDOW, swiglu_limit=0.6, rope_parameters=YARN,
)  # fmt: skip


def perturb_gpt_oss(model: torch.nn.Module) -> None:
    """Norms and biases off their init, the experts' [E, out] biases too (transformers starts
    them at zero, where a bias cut or added twice under TP would go unseen)."""
    perturb_norms_and_biases(model)
    gen = torch.Generator().manual_seed(11)
    for name, param in model.named_parameters():
        if name.endswith(("experts.gate_up_proj_bias", "experts.down_proj_bias")):
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))


def save_tiny_gpt_oss(path: str) -> torch.nn.Module:
    return save_tiny_hf(path, "gpt_oss", "GptOssForCausalLM", perturb=perturb_gpt_oss,
                        **TINY_GPT_OSS)  # fmt: skip


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gpt_oss") / "src")
    model = save_tiny_gpt_oss(path)
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_batched_and_alone_equal_hf(gpt_oss) -> None:
    _, want, llm = gpt_oss
    model = llm.engine.executor.runner.model
    assert [layer.self_attn.kind.sliding_window for layer in model.layers] == [WINDOW, None]
    attn, experts = model.layers[0].self_attn, model.layers[0].mlp.experts
    assert attn.sinks is not None and attn.sinks.abs().min() > 0  # loaded, not left at zero
    assert experts.swiglu == (1.702, 0.6) and experts.w13_bias.shape == (4, 64)
    assert model.layers[0].mlp.gate.bias is not None
    assert max(len(p) for p in PROMPTS) > WINDOW
    check_alone_and_batched(llm, want)


def test_chunked_prefix_cached_and_preempted_equal_hf(gpt_oss) -> None:
    path, want, llm = gpt_oss
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    # Windowed and full layers: two KV cache groups over one pool.
    check_preempted(path, want, kv_groups=len(llm.engine.kv_cache.groups))


def test_float8_experts_per_channel_stay_close(gpt_oss) -> None:
    path, _, llm = gpt_oss
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    model = fp8.engine.executor.runner.model
    experts = model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    assert experts.w13_weight_scale.shape == (4, 64) and experts.w2_weight_scale.shape == (4, 64)
    assert experts.w13_bias.dtype == torch.float32  # biases stay in the model dtype
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model.config, torch.float32, "fp8-dynamic") == made
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_the_memory_plan_counts_every_expert_bias_and_sink(gpt_oss) -> None:
    _, _, llm = gpt_oss
    model = llm.engine.executor.runner.model
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert llm.engine.memory_plan.weight_bytes == made
    assert weight_bytes(model.config, torch.float32, "none") == made


def test_the_presets_are_gpt_oss_and_20b_fits_one_80gb_gpu() -> None:
    small = ModelConfig.from_hf_dict(PRESETS["gpt-oss-20b"])
    large = ModelConfig.from_hf_dict(PRESETS["gpt-oss-120b"])
    assert (small.num_experts, large.num_experts) == (32, 128)
    assert small.layer_types[:2] == ("sliding_attention", "full_attention")
    assert small.sliding_window == 128 and small.attention_sinks and small.moe_bias
    assert small.rope_scaling["rope_type"] == "yarn" and small.swiglu_limit == 7.0
    params = sum(small.parameter_counts().values())
    assert 20.5e9 < params < 21.5e9  # OpenAI's 20.9B (embeddings and head included)
    assert 116e9 < sum(large.parameter_counts().values()) < 118e9  # 116.8B
    fp8 = weight_bytes(small, torch.bfloat16, "fp8-dynamic")
    assert fp8 < 25 * 2**30  # ~22 GiB: the rest of an 80 GB GPU holds the KV cache


@pytest.mark.parametrize("quantization", ["none", "fp8-dynamic"])
def test_an_engine_directory_builds_and_loads(gpt_oss, tmp_path, quantization) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    path, want, _ = gpt_oss
    out = str(tmp_path / "engine")
    options = BuildOptions(
        dtype="float32", quantization=quantization, accuracy_check=False, max_model_len=256
    )
    build_engine(path, out, options, None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    if quantization == "none":
        assert tokens(engine.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]
        return
    experts = engine.engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w13_weight.dtype == torch.float8_e4m3fn
    at_load = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(at_load.generate(PROMPTS, GREEDY))


def test_dummy_float8_weights_run_at_unit_expert_scales(gpt_oss) -> None:
    path, _, _ = gpt_oss
    dummy = LLM(path, quantization="fp8-dynamic", load_format="dummy", **ARGS)
    experts = dummy.engine.executor.runner.model.layers[1].mlp.experts
    assert experts.w13_weight_scale.shape == (4, 64) and (experts.w13_weight_scale == 1).all()
    assert len(tokens(dummy.generate(PROMPTS[:1], GREEDY))[0]) == 32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(gpt_oss) -> None:
    """Triton kernels (sinks and windows in attention, the grouped GEMM with biases and the
    clamped SwiGLU) with decode in CUDA graphs equal to HF in fp32; FP8 with float8 experts and
    a float8 KV cache within float8's noise."""
    path, want, llm = gpt_oss
    check_gpu(path, want, llm)
