"""DeepSeek-V3 and DeepSeek-V2 (multi-head latent attention over DeepSeek's experts) against
Hugging Face in fp32 (eager attention) on tiny random checkpoints: V3 with a low-rank query
(q_lora_rank 32), yarn rope with mscale_all_dim (the softmax scale's mscale^2), interleaved
rotary pairs, a dense first layer, then sigmoid routing over 2 groups with a routing bias, a
routing scale and a shared expert; V3 with q_proj (q_lora_rank None) and rotate-half rotary;
V2-Lite's shape (softmax routing, no renormalisation). Greedy tokens equal over 32 new tokens
alone, batched, chunked, prefix-cached and preempted; the cache holds one [k_pe | c_kv] row
per token, one tensor for K and V, and the memory plan counts that; fp8-dynamic weights, a
float8 cache and DeepSeek's own block-FP8 release within float8's noise."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.models.blocks import decoder_layers
from kiln.models.config import PRESETS, ModelConfig
from kiln.runtime.config_plan import weight_bytes
from kiln.runtime.memory_plan import kv_bytes_per_token
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_gpu,
    check_preempted,
    check_prefix_hit,
    hf_tokens,
    save_tiny_hf,
    tokens,
)
from tests.models.test_glm4_moe import perturb_glm
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS

MLA = dict(num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=16, moe_intermediate_size=32, n_shared_experts=1)  # fmt: skip
DEEPSEEK_V3 = dict(
    **MLA, num_hidden_layers=3, first_k_dense_replace=1, n_routed_experts=8,
    num_experts_per_tok=2, n_group=2, topk_group=1, routed_scaling_factor=1.5,
    norm_topk_prob=True, q_lora_rank=32,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 0.7,
                  "beta_fast": 32, "beta_slow": 1, "original_max_position_embeddings": 128},
)  # fmt: skip
DEEPSEEK_V3_NO_Q_LORA = dict(
    **MLA, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=None, rope_interleave=False,
)  # fmt: skip
DEEPSEEK_V2_LITE = dict(
    **MLA, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, q_lora_rank=None, topk_method="greedy", n_group=1, topk_group=1,
    routed_scaling_factor=1.0,
)  # fmt: skip


def _checkpoint(tmp_path_factory, model_type: str, architecture: str, overrides: dict):
    path = str(tmp_path_factory.mktemp(model_type) / "src")
    model = save_tiny_hf(path, model_type, architecture, perturb=perturb_glm, **overrides)
    return path, model


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path, model = _checkpoint(tmp_path_factory, "deepseek_v3", "DeepseekV3ForCausalLM",
                              DEEPSEEK_V3)  # fmt: skip
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS), model


def test_the_layers_are_mla_shaped(v3) -> None:
    _, _, llm, hf = v3
    runner = llm.engine.executor.runner
    model, cfg = runner.model, runner.model.config
    # The cache's one head: the 8 rotary dims of the shared key, then the 32-wide latent.
    assert (cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim) == (1, 40, 8)
    assert (cfg.moe_routing, cfg.n_group, cfg.topk_group) == ("sigmoid", 2, 1)
    assert cfg.rope_interleave and cfg.kv_tensors_per_layer == 1
    assert [type(layer.self_attn).__name__ for layer in model.layers] == ["LatentAttention"] * 3
    assert [type(layer.mlp).__name__ for layer in model.layers] == [
        "GatedMLP", "SparseMoeBlock", "SparseMoeBlock"
    ]  # fmt: skip
    k_cache, v_cache = runner.kv_caches[0]
    assert k_cache is v_cache and k_cache.shape[2:] == (1, 40)
    # One fp32 row of 40 per layer and token, not 2 x 4 heads x (24 + 16) expanded.
    assert kv_bytes_per_token(cfg, torch.float32) == 3 * 40 * 4
    plan = llm.engine.memory_plan
    assert plan.bytes_per_block == 3 * 40 * 4 * 16 and plan.layer_token_bytes == 40 * 4
    assert k_cache.shape[0] == plan.num_blocks  # one tensor of them per layer
    # The yarn mscale_all_dim's square on the softmax scale, as transformers has it.
    assert model.layers[0].self_attn.scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    with pytest.raises(TypeError, match="LatentAttention"):  # calibration walks RopeAttention
        decoder_layers(model)
    # A release's multi-token-prediction layer (numbered after the last) is dropped at load.
    mtp = [("model.layers.3.eh_proj.weight", torch.zeros(2)), ("model.norm.weight", torch.ones(2))]
    assert [name for name, _ in model.adapt_hf_weights(mtp)] == ["model.norm.weight"]


def test_batched_and_alone_equal_hf(v3) -> None:
    _, want, llm, _ = v3
    check_alone_and_batched(llm, want)


def test_chunked_prefix_cached_and_preempted_equal_hf(v3) -> None:
    path, want, llm, _ = v3
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


def test_the_memory_plan_counts_every_parameter(v3) -> None:
    _, _, llm, _ = v3
    model = llm.engine.executor.runner.model
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert llm.engine.memory_plan.weight_bytes == made
    assert weight_bytes(model.config, torch.float32, "none") == made


def test_fp8_dynamic_stays_close(v3) -> None:
    path, _, llm, _ = v3
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    model = fp8.engine.executor.runner.model
    attn = model.layers[1].self_attn
    assert attn.qkv_a_proj.weight.dtype == torch.float8_e4m3fn
    assert attn.kv_b_proj.weight.dtype == torch.float32  # absorbed: kept in the model dtype
    made = sum(p.numel() * p.element_size() for p in model.parameters())
    assert fp8.engine.memory_plan.weight_bytes == made
    assert weight_bytes(model.config, torch.float32, "fp8-dynamic") == made
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_an_fp8_dynamic_engine_directory_builds_and_loads(v3, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    path, _, _, _ = v3
    out = str(tmp_path / "engine")
    options = BuildOptions(quantization="fp8-dynamic", accuracy_check=False, max_model_len=256)
    build_engine(path, out, options, None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    cfg = engine.engine.executor.runner.model.config
    mla = (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim, cfg.rope_interleave)
    assert mla == (32, 32, 40, True)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["mscale_all_dim"] == 0.7
    fp8 = LLM(path, quantization="fp8-dynamic", max_num_batched_tokens=64, **ARGS)
    assert tokens(engine.generate(PROMPTS, GREEDY)) == tokens(fp8.generate(PROMPTS, GREEDY))


def test_a_static_fp8_build_calibrates_around_the_absorbed_kv_b_proj(v3, tmp_path) -> None:
    """Calibration observes every applied projection; kv_b_proj (multiplied in, never applied)
    is left out and stays in the model dtype."""
    from kiln.builder.build import BuildOptions, build_engine

    path, _, llm, _ = v3
    out = str(tmp_path / "engine")
    options = BuildOptions(quantization="fp8", accuracy_check=False, max_model_len=256)
    build_engine(path, out, options, None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    attn = engine.engine.executor.runner.model.layers[1].self_attn
    assert attn.o_proj.weight.dtype == torch.float8_e4m3fn and attn.o_proj.input_scale is not None
    assert attn.kv_b_proj.weight.dtype == torch.float32
    gaps = generated_logprob_gaps(engine.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_a_float8_cache_stays_close(v3, monkeypatch) -> None:
    """The latent rows in e4m3 (unscaled, as kiln's float8 cache is without calibration),
    decodes reading them through the MLA decode's twin."""
    from kiln.kernels import reference
    from tests.models.test_deepseek_triton import record_calls

    path, _, llm, _ = v3
    fp8 = LLM(path, kv_cache_dtype="fp8", max_num_batched_tokens=64, **ARGS)
    k_cache, v_cache = fp8.engine.executor.runner.kv_caches[0]
    assert k_cache is v_cache and k_cache.dtype == torch.float8_e4m3fn
    assert fp8.engine.memory_plan.bytes_per_block == 3 * 40 * 16
    decodes = record_calls(monkeypatch, reference)
    outputs = fp8.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert decodes and {dtype for _, dtype in decodes} == {torch.float8_e4m3fn}
    gaps = generated_logprob_gaps(outputs, llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_an_int8_cache_is_refused_by_name(v3, tmp_path) -> None:
    """At load and at build: the latent rows have no block that folds int8's scales."""
    from kiln.builder.build import BuildOptions, build_engine
    from kiln.errors import BuildError, ModelLoadError

    refusal = "int8 KV cache .* multi-head latent attention"
    with pytest.raises(ModelLoadError, match=refusal):
        LLM(v3[0], kv_cache_dtype="int8", max_num_batched_tokens=64, **ARGS)
    options = BuildOptions(kv_cache_dtype="int8", accuracy_check=False, max_model_len=256)
    with pytest.raises(BuildError, match=refusal):
        build_engine(v3[0], str(tmp_path / "engine"), options, None)


@pytest.mark.parametrize(
    ("model_type", "architecture", "overrides"),
    [
        ("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_V3_NO_Q_LORA),
        ("deepseek_v2", "DeepseekV2ForCausalLM", DEEPSEEK_V2_LITE),
    ],
    ids=["v3-q-proj", "v2-lite"],
)
def test_a_q_proj_and_v2_equal_hf(tmp_path_factory, model_type, architecture, overrides) -> None:
    path, model = _checkpoint(tmp_path_factory, model_type, architecture, overrides)
    want = hf_tokens(model, PROMPTS)
    llm = LLM(path, max_num_batched_tokens=64, **ARGS)
    cfg = llm.engine.executor.runner.model.config
    assert cfg.q_lora_rank is None and cfg.rope_interleave == (model_type == "deepseek_v2")
    assert cfg.moe_routing == ("softmax" if model_type == "deepseek_v2" else "sigmoid")
    check_alone_and_batched(llm, want)


def test_the_presets_have_the_published_parameter_counts() -> None:
    cfg = ModelConfig.from_hf_dict(PRESETS["deepseek-v3"])
    total = sum(cfg.parameter_counts().values())
    assert abs(total - 671e9) < 0.005 * 671e9, total  # the published 671B (MTP not counted)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.rotary_dim) == (576, 1, 64)
    assert kv_bytes_per_token(cfg, torch.bfloat16) == 61 * 576 * 2  # 69 KiB a token
    lite = ModelConfig.from_hf_dict(PRESETS["deepseek-v2-lite"])
    total = sum(lite.parameter_counts().values())
    assert abs(total - 15.7e9) < 0.005 * 15.7e9, total  # the published 15.7B
    assert (lite.q_lora_rank, lite.moe_routing, lite.norm_topk_prob) == (None, "softmax", False)


def test_unsupported_v2_routing_is_refused() -> None:
    from kiln.errors import ModelLoadError

    d = ModelConfig.from_hf_dict(PRESETS["deepseek-v3"]).to_hf_dict()
    d.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
             topk_method="group_limited_greedy", routed_scaling_factor=16.0)  # fmt: skip
    with pytest.raises(ModelLoadError, match="group_limited_greedy"):
        ModelConfig.from_hf_dict(d)


def test_a_block_fp8_release_loads(v3, tmp_path) -> None:
    """DeepSeek-V3's own FP8 format (128x128 weight_scale_inv on every projection): the codes
    load as written (the fused q_a / kv_a_proj_with_mqa and its de-interleaved rotary rows
    too), kv_b_proj widened to its dequantized values, within float8's noise of the
    dequantized checkpoint."""
    from safetensors import safe_open

    from tests.models.test_moe_fp8_block import write_fp8_release

    path = str(tmp_path / "fp8")
    write_fp8_release(v3[0], path)
    fp8 = LLM(path, max_num_batched_tokens=64, **ARGS)
    dequantized = LLM(f"{path}-dequantized", max_num_batched_tokens=64, **ARGS)
    attn = fp8.engine.executor.runner.model.layers[1].self_attn
    assert attn.qkv_a_proj.weight.dtype == attn.q_b_proj.weight.dtype == torch.float8_e4m3fn
    with safe_open(f"{path}-dequantized/model.safetensors", framework="pt") as f:
        want = f.get_tensor("model.layers.1.self_attn.kv_b_proj.weight")
    assert torch.equal(attn.kv_b_proj.weight, want)
    outputs = fp8.generate(PROMPTS, GREEDY)
    gaps = generated_logprob_gaps(outputs, dequantized.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_the_gpu_path(v3) -> None:
    """Triton kernels with decode in CUDA graphs (the shared MQA kernels over the 40-wide
    latent rows), fp32: HF's tokens; fp8-dynamic with a float8 cache within its noise."""
    path, want, llm, _ = v3
    check_gpu(path, want, llm)
