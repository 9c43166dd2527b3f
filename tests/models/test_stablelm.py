"""StableLM 2 on the model plug-in, against Hugging Face in fp32: LayerNorms with biases,
partial rotary (a quarter of each head), q/k/v biases, and the parallel-residual variant;
greedy tokens equal over 32 new tokens alone, batched, chunked, prefix-cached
and preempted; FP8 weights
within float8's noise."""

from __future__ import annotations

import pytest

from kiln import LLM
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
from tests.models.test_qwen3 import ARGS, PREFIXED, PROMPTS

STABLELM = dict(partial_rotary_factor=0.25, use_qkv_bias=True, layer_norm_eps=1e-5)


@pytest.fixture(scope="module", params=[False, True], ids=["sequential", "parallel"])
def stablelm(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stablelm") / "src")
    model = save_tiny_hf(path, "stablelm", "StableLmForCausalLM", perturb=perturb_norms_and_biases,
                         use_parallel_residual=request.param, **STABLELM)  # fmt: skip
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return request.param, path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_batched_and_alone_equal_hf(stablelm) -> None:
    parallel, _, want, llm = stablelm
    model = llm.engine.executor.runner.model
    assert model.config.rotary_dim == 4 and model.norm_bias is not None
    assert model.layers[0].parallel == parallel
    check_alone_and_batched(llm, want)


def test_chunked_and_prefix_cached_equal_hf(stablelm) -> None:
    _, path, want, llm = stablelm
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


def test_fp8_dynamic_stays_close(stablelm) -> None:
    parallel, path, _, llm = stablelm
    if not parallel:
        check_fp8_close(path, llm)
