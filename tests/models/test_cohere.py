"""Cohere (Command-R) on the model plug-in, against Hugging Face in fp32: LayerNorms without
biases, attention and MLP in parallel, interleaved rotary (q/k rows reordered at load),
logit_scale (seen in the logprobs), tied embeddings, attention biases; greedy tokens equal over
32 new tokens alone, batched, chunked, prefix-cached
and preempted."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_gpu,
    check_preempted,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
)
from tests.models.test_models_vs_hf import assert_greedy_matches_hf
from tests.models.test_qwen3 import ARGS, PREFIXED, PROMPTS


@pytest.fixture(scope="module")
def cohere(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("cohere") / "src")
    model = save_tiny_hf(path, "cohere", "CohereForCausalLM", perturb=perturb_norms_and_biases,
                         logit_scale=0.25, attention_bias=True, layer_norm_eps=1e-5)  # fmt: skip
    assert model.config.tie_word_embeddings
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS), model


def test_batched_and_alone_equal_hf(cohere) -> None:
    _, want, llm, hf_model = cohere
    model = llm.engine.executor.runner.model
    assert model.lm_head is None and model.layers[0].parallel
    check_alone_and_batched(llm, want)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert_greedy_matches_hf(hf_model, PROMPTS[0], out, 1e-4, "cohere")


def test_chunked_and_prefix_cached_equal_hf(cohere) -> None:
    path, want, llm, _ = cohere
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(cohere) -> None:
    path, want, llm = cohere[:3]
    check_gpu(path, want, llm, PROMPTS)
