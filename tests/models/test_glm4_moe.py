"""GLM-4.5 (Glm4MoeForCausalLM) against Hugging Face in fp32 (eager attention) on a tiny random
checkpoint: the first layer dense, the others DeepSeek-V3's sigmoid-routed experts (a routing
bias large enough to change the choice, 2 groups of which each token keeps 1, a routing scale)
plus an ungated shared expert; q/k/v biases, per-head q/k RMSNorm, rotary on half of each
head. Greedy tokens equal over 32 new tokens alone, batched, chunked, prefix-cached and
preempted; fp8-dynamic experts within float8's noise, and as an engine directory; the memory
plan exact."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.builder.plan import weight_bytes
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_preempted,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
    tokens,
)
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS

GLM = dict(
    num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, n_shared_experts=1, n_group=2, topk_group=1,
    routed_scaling_factor=1.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
    head_dim=32, partial_rotary_factor=0.5,
)  # fmt: skip


def perturb_glm(model: torch.nn.Module) -> None:
    """Norms and biases off their constants, and the routers' correction biases as large as
    the sigmoid scores' spread (transformers zeroes them; a real checkpoint's are not)."""
    perturb_norms_and_biases(model)
    gen = torch.Generator().manual_seed(11)
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):  # spread the router's scores
            param.mul_(20.0)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("glm4_moe") / "src")
    model = save_tiny_hf(path, "glm4_moe", "Glm4MoeForCausalLM", perturb=perturb_glm, **GLM)
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS), model


def test_the_layers_are_glm_shaped(glm) -> None:
    _, _, llm, hf = glm
    model = llm.engine.executor.runner.model
    cfg = model.config
    assert (cfg.moe_routing, cfg.n_group, cfg.topk_group) == ("sigmoid", 2, 1)
    assert cfg.rotary_dim == 16 and cfg.qk_layernorm and cfg.attention_bias
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "GatedMLP", "SparseMoeBlock", "SparseMoeBlock"
    ]  # fmt: skip
    moe = model.layers[1].mlp
    assert moe.shared_expert is not None and moe.shared_expert_gate is None
    assert not moe.experts.routes_in_experts(1)  # the experts' kernel routes by softmax only
    want = hf.model.layers[1].mlp.gate.e_score_correction_bias
    assert torch.equal(moe.experts.e_score_correction_bias, want)
    assert moe.experts.e_score_correction_bias.dtype == torch.float32
    # A release's multi-token-prediction layer (numbered after the last) is dropped at load.
    mtp = [("model.layers.3.eh_proj.weight", torch.zeros(2)), ("model.norm.weight", torch.ones(2))]
    assert [name for name, _ in model.adapt_hf_weights(mtp)] == ["model.norm.weight"]


def test_batched_and_alone_equal_hf(glm) -> None:
    _, want, llm, _ = glm
    check_alone_and_batched(llm, want)


def test_chunked_prefix_cached_and_preempted_equal_hf(glm) -> None:
    path, want, llm, _ = glm
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


def test_an_fp8_dynamic_engine_directory_builds_and_loads(glm, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    path, _, llm, _ = glm
    out = str(tmp_path / "engine")
    options = BuildOptions(quantization="fp8-dynamic", accuracy_check=False, max_model_len=256)
    build_engine(path, out, options, None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    cfg = engine.engine.executor.runner.model.config
    assert (cfg.moe_routing, cfg.n_group, cfg.routed_scaling_factor) == ("sigmoid", 2, 1.5)
    assert (cfg.first_k_dense_replace, cfg.shared_expert_gated, cfg.rotary_dim) == (1, False, 16)
    moe = engine.engine.executor.runner.model.layers[1].mlp
    assert moe.experts.w13_weight.dtype == torch.float8_e4m3fn
    want = llm.engine.executor.runner.model.layers[1].mlp.experts.e_score_correction_bias
    assert torch.equal(moe.experts.e_score_correction_bias, want)
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(fp8.generate(PROMPTS, GREEDY))


def test_fp8_dynamic_experts_stay_close(glm) -> None:
    path, _, llm, _ = glm
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    moe = fp8.engine.executor.runner.model.layers[1].mlp
    assert moe.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert moe.experts.e_score_correction_bias.dtype == torch.float32
    made = sum(p.numel() * p.element_size() for p in fp8.engine.executor.runner.model.parameters())
    assert fp8.engine.memory_plan.weight_bytes == made
    plan = weight_bytes(fp8.engine.executor.runner.model.config, torch.float32, "fp8-dynamic")
    assert plan == made - 2 * 3 * 32 * 4  # the build's plan leaves out the per-head q/k norms
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_the_memory_plan_counts_every_parameter(glm) -> None:
    _, _, llm, _ = glm
    model = llm.engine.executor.runner.model
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert llm.engine.memory_plan.weight_bytes == made
    qk_norms = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("k_norm"))
    assert weight_bytes(model.config, torch.float32, "none") == made - 2 * qk_norms


def test_bf16_keeps_the_router_and_its_bias_in_fp32(glm) -> None:
    path, _, _, _ = glm
    llm = LLM(path, dtype="bfloat16", max_num_batched_tokens=64, **ARGS)
    model = llm.engine.executor.runner.model
    moe = model.layers[1].mlp
    assert moe.experts.w13_weight.dtype == torch.bfloat16
    assert moe.gate.weight.dtype == moe.experts.e_score_correction_bias.dtype == torch.float32
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert llm.engine.memory_plan.weight_bytes == made
    assert weight_bytes(model.config, torch.bfloat16, "none") == made - 2 * 3 * 32 * 2
    assert len(tokens(llm.generate(PROMPTS[:1], GREEDY))[0]) == 32
