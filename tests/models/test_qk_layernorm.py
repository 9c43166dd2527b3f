"""The per-head q/k LayerNorm (RopeAttention qk_norm="head_layer") against Hugging Face in
fp32: StableLM 2 with qk_layernorm (a LayerNorm module per head in the checkpoint, stacked at
load) and Cohere with use_qk_norm (one [heads, head_dim] weight, its dims reordered with the
interleaved rotary's); greedy tokens equal over 32 new tokens alone, batched, chunked and
prefix-cached; each tensor rank holds its heads' rows."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_fp8_close,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
)
from tests.models.test_qwen3 import ARGS, PREFIXED, PROMPTS

VARIANTS = {
    "stablelm": ("stablelm", "StableLmForCausalLM",
                 dict(qk_layernorm=True, partial_rotary_factor=0.25, use_qkv_bias=True)),
    "cohere": ("cohere", "CohereForCausalLM",
               dict(use_qk_norm=True, logit_scale=0.25, attention_bias=True)),
}  # fmt: skip


def perturb(model: torch.nn.Module) -> None:
    """Every norm and bias moved off its init, the [heads, head_dim] q/k norms too (each head
    differently, so a head's rows landing on another's would show)."""
    perturb_norms_and_biases(model)
    gen = torch.Generator().manual_seed(11)
    for name, param in model.named_parameters():
        if param.dim() == 2 and "norm" in name:
            param.copy_(1.0 + 0.5 * torch.randn(param.shape, generator=gen))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def family(request, tmp_path_factory):
    model_type, hf_class, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param) / "src")
    model = save_tiny_hf(path, model_type, hf_class, perturb=perturb, layer_norm_eps=1e-5,
                         **overrides)  # fmt: skip
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return request.param, path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_batched_and_alone_equal_hf(family) -> None:
    _, _, want, llm = family
    attn = llm.engine.executor.runner.model.layers[0].self_attn
    assert attn.head_layer_norm and attn.q_norm.shape == (4, 16) and attn.k_norm.shape == (2, 16)
    check_alone_and_batched(llm, want)


def test_chunked_and_prefix_cached_equal_hf(family) -> None:
    _, path, want, llm = family
    check_prefix_hit(llm, want)
    check_chunked(path, want)


def test_fp8_weights_and_float8_kv_cache_stay_close(family) -> None:
    """FP8 W8A8 with a float8 KV cache: keys written after the per-head norms."""
    _, path, _, llm = family
    check_fp8_close(path, llm, kv_cache_dtype="fp8")


def test_an_fp8_build_with_a_calibrated_float8_cache_stays_close(family, tmp_path) -> None:
    """`kiln build --quantization fp8 --kv-cache-dtype fp8`: calibration measures the keys
    after the per-head norms and folds their scale into k_norm; the engine loads."""
    from kiln.builder.build import BuildOptions, build_engine
    from tests.conftest import generated_logprob_gaps
    from tests.models.test_qwen3 import GREEDY

    _, path, _, llm = family
    out = str(tmp_path / "fp8")
    options = BuildOptions(dtype="float32", quantization="fp8", kv_cache_dtype="fp8",
                           accuracy_check=False, max_model_len=256)  # fmt: skip
    build_engine(path, out, options, None)
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    assert engine.engine.executor.runner.model.layers[0].self_attn.folded_kv_scales is not None
    gaps = generated_logprob_gaps(engine.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_each_tensor_rank_holds_its_heads_norms(family) -> None:
    from kiln.config import EngineConfig
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.runtime.model_loader import load_model

    path = family[1]
    cpu, fp32 = torch.device("cpu"), torch.float32
    whole = dict(load_model(EngineConfig(model=path), cpu, fp32).model.named_parameters())
    for rank in range(2):
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        part = load_model(EngineConfig(model=path, tensor_parallel_size=2), cpu, fp32, ctx)
        got = dict(part.model.named_parameters())
        for norm, per_rank in (("q_norm", 2), ("k_norm", 1)):
            name = f"layers.1.self_attn.{norm}"
            assert torch.equal(got[name], whole[name][rank * per_rank : (rank + 1) * per_rank])
