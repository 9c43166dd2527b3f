"""The mixture-of-experts families (Mixtral, Qwen3-MoE, Qwen2-MoE) against Hugging Face in fp32
(eager attention) on tiny random checkpoints: greedy tokens equal over 32 new tokens alone,
batched, chunked, prefix-cached and preempted; Qwen3-MoE's dense `mlp_only_layers` and
renormalised top-k, Qwen2-MoE's sigmoid-gated shared expert and unrenormalised top-k; engine
directories built and loaded (Qwen3-MoE; Qwen2-MoE with fp8-dynamic experts); float8 experts
within float8's noise; the memory plan counting every expert."""

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

EXPERTS = dict(num_experts_per_tok=2, moe_intermediate_size=32)
FAMILIES = {
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(num_local_experts=4, intermediate_size=32,
                                                       num_experts_per_tok=2)),
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(
        num_experts=4, num_hidden_layers=3, mlp_only_layers=[1], norm_topk_prob=True,
        head_dim=32, **EXPERTS)),
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(
        num_experts=4, norm_topk_prob=False, shared_expert_intermediate_size=48, **EXPERTS)),
}  # fmt: skip


@pytest.fixture(scope="module", params=list(FAMILIES))
def moe(request, tmp_path_factory):
    model_type, architecture, overrides = FAMILIES[request.param]
    path = str(tmp_path_factory.mktemp(model_type) / "src")
    model = save_tiny_hf(path, model_type, architecture, perturb=perturb_norms_and_biases,
                         **overrides)  # fmt: skip
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return request.param, path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_batched_and_alone_equal_hf(moe) -> None:
    family, _, want, llm = moe
    layers = llm.engine.executor.runner.model.layers
    sparse = [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in layers]
    assert sparse == ([True, False, True] if family == "qwen3_moe" else [True, True])
    assert layers[0].mlp.experts.w13_weight.shape == (4, 64, 64)
    assert (layers[0].mlp.shared_expert is not None) == (family == "qwen2_moe")
    check_alone_and_batched(llm, want)


def test_chunked_and_prefix_cached_equal_hf(moe) -> None:
    _, path, want, llm = moe
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


@pytest.mark.parametrize("moe", ["qwen3_moe"], indirect=True)  # one family is enough
def test_an_engine_directory_builds_and_loads(moe, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    _, path, want, _ = moe
    out = str(tmp_path / "engine")
    build_engine(
        path, out, BuildOptions(dtype="float32", accuracy_check=False, max_model_len=256), None
    )
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]


@pytest.mark.parametrize("moe", ["qwen2_moe"], indirect=True)  # one family is enough
def test_fp8_dynamic_experts_stay_close(moe) -> None:
    _, path, _, llm = moe
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    layer = fp8.engine.executor.runner.model.layers[0]
    assert layer.mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.experts.w2_weight_scale.shape == (4,)
    assert layer.mlp.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.gate.weight.dtype == torch.float32  # the router stays unquantized
    made = fp8.engine.executor.runner.model.parameters()
    made_bytes = sum(p.numel() * p.element_size() for p in made)
    assert fp8.engine.memory_plan.weight_bytes == made_bytes
    plan = weight_bytes(fp8.engine.executor.runner.model.config, torch.float32, "fp8-dynamic")
    assert plan == made_bytes
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


@pytest.mark.parametrize("moe", ["qwen2_moe"], indirect=True)  # one family is enough
def test_an_fp8_dynamic_engine_directory_and_dummy_weights(moe, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    _, path, _, llm = moe
    out = str(tmp_path / "fp8")
    options = BuildOptions(quantization="fp8-dynamic", accuracy_check=False, max_model_len=256)
    build_engine(path, out, options, None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    experts = engine.engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w2_weight.dtype == torch.float8_e4m3fn
    gaps = generated_logprob_gaps(engine.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps
    dummy = LLM(path, quantization="fp8-dynamic", load_format="dummy", **ARGS)
    assert len(tokens(dummy.generate(PROMPTS[:1], GREEDY))[0]) == 32
    # The benchmarks' FP8 setup (dummy weights, stand-in static scales) has float8 experts too.
    static = LLM(path, quantization="fp8", load_format="dummy", **ARGS)
    experts = static.engine.executor.runner.model.layers[0].mlp.experts
    assert experts.w2_weight.dtype == torch.float8_e4m3fn
    assert len(tokens(static.generate(PROMPTS[:1], GREEDY))[0]) == 32


def test_the_memory_plan_counts_every_expert(moe) -> None:
    _, _, _, llm = moe
    model = llm.engine.executor.runner.model
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert llm.engine.memory_plan.weight_bytes == made
    # The build's plan, from the config alone, leaves out the (tiny) per-head q/k norms.
    qk_norms = sum(p.numel() * 4 for n, p in model.named_parameters() if n.endswith("k_norm"))
    assert weight_bytes(model.config, torch.float32, "none") == made - 2 * qk_norms
    experts = sum(
        layer.mlp.experts.w13_weight.numel() + layer.mlp.experts.w2_weight.numel()
        for layer in model.layers
        if hasattr(layer.mlp, "experts")
    )
    dense = model.config.num_hidden_layers * 3 * 64 * model.config.intermediate_size
    assert made > experts * 4 > dense * 4 / 2  # the experts are most of the MLP bytes
    # The decode roofline reads the experts apart (kiln.bench.roofline).
    assert llm.engine.memory_plan.expert_weight_bytes == experts * 4
