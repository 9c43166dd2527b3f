"""Granite 3 on the model plug-in, against Hugging Face in fp32: its embedding, residual,
attention and logits multipliers (the logits' shows in the logprobs, not the argmax), tied
embeddings, attention and MLP biases; greedy tokens equal over 32 new tokens alone, batched,
chunked, prefix-cached
and preempted; FP8 weights within float8's noise."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_fp8_close,
    check_preempted,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
)
from tests.models.test_models_vs_hf import assert_greedy_matches_hf
from tests.models.test_qwen3 import ARGS, PREFIXED, PROMPTS

GRANITE = dict(
    embedding_multiplier=6.0,
    residual_multiplier=0.3,
    attention_multiplier=0.09,
    logits_scaling=4.0,
    tie_word_embeddings=True,
    attention_bias=True,
    mlp_bias=True,
)


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("granite") / "src")
    model = save_tiny_hf(path, "granite", "GraniteForCausalLM", perturb=perturb_norms_and_biases,
                         **GRANITE)  # fmt: skip
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS), model


def test_batched_and_alone_equal_hf(granite) -> None:
    _, want, llm, hf_model = granite
    model = llm.engine.executor.runner.model
    assert model.embedding_multiplier == 6.0 and model.layers[0].self_attn.scale == 0.09
    check_alone_and_batched(llm, want)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert_greedy_matches_hf(hf_model, PROMPTS[0], out, 1e-4, "granite")


def test_chunked_and_prefix_cached_equal_hf(granite) -> None:
    path, want, llm, _ = granite
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


def test_fp8_dynamic_stays_close(granite) -> None:
    path, _, llm, _ = granite
    check_fp8_close(path, llm)
