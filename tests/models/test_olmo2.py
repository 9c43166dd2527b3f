"""OLMo 2 on the model plug-in, against Hugging Face in fp32: norms after the blocks, a q/k
RMSNorm over the whole projection; greedy tokens equal over 32 new tokens alone, batched,
chunked, prefix-cached
and preempted; a `kiln build --quantization fp8 --kv-cache-dtype fp8` engine
(the key scales folded into the full-width k_norm) within float8's noise."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
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
)
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS


@pytest.fixture(scope="module")
def olmo2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("olmo2") / "src")
    model = save_tiny_hf(path, "olmo2", "Olmo2ForCausalLM", perturb=perturb_norms_and_biases)
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_batched_and_alone_equal_hf(olmo2) -> None:
    _, want, llm = olmo2
    attn = llm.engine.executor.runner.model.layers[0].self_attn
    assert attn.full_qk_norm and attn.k_norm.shape == (2 * 16,)
    check_alone_and_batched(llm, want)


def test_chunked_and_prefix_cached_equal_hf(olmo2) -> None:
    path, want, llm = olmo2
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


def test_an_fp8_build_loads_and_stays_close(olmo2, tmp_path) -> None:
    from kiln.builder.build import BuildOptions, build_engine

    path, _, llm = olmo2
    out = str(tmp_path / "fp8")
    options = BuildOptions(
        dtype="float32",
        quantization="fp8",
        kv_cache_dtype="fp8",
        accuracy_check=False,
        max_model_len=256,
    )
    manifest = build_engine(path, out, options, None)
    assert len(manifest.kv_scales) == 2 and manifest.kv_scales_in_weights
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    attn = engine.engine.executor.runner.model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    gaps = generated_logprob_gaps(engine.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(olmo2) -> None:
    path, want, llm = olmo2[:3]
    check_gpu(path, want, llm, PROMPTS)
