"""Starcoder2 against Hugging Face in fp32 (eager attention), prompts longer than its window:
LayerNorms with biases, q/k/v/o biases, the ungated GELU-tanh MLP, tied embeddings, a window
of 7 on every layer (the KV manager frees the blocks behind it); greedy tokens equal over 32
new tokens alone, batched, chunked, preempted and prefix-cached."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.attention.backend import AttentionKind
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_fp8_close,
    check_gpu,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
    tokens,
    write_gguf,
)
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS


@pytest.fixture(scope="module")
def starcoder2(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("starcoder2") / "src")
    model = save_tiny_hf(
        path, "starcoder2", "Starcoder2ForCausalLM", perturb=perturb_norms_and_biases,
        sliding_window=7,
    )  # fmt: skip
    assert model.config.tie_word_embeddings and model.config.use_bias
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_blocks_and_window(starcoder2) -> None:
    _, _, llm = starcoder2
    model = llm.engine.executor.runner.model
    layer = model.layers[0]
    assert layer.layer_norm and layer.input_layernorm_bias is not None
    assert layer.mlp.c_fc.bias is not None and layer.self_attn.o_proj.bias is not None
    assert {layer.self_attn.kind for layer in model.layers} == {AttentionKind(7)}
    assert llm.engine.kv_cache.sliding_window == 7


def test_batched_alone_and_prefix_cached_equal_hf(starcoder2) -> None:
    _, want, llm = starcoder2
    check_alone_and_batched(llm, want)
    check_prefix_hit(llm, want)


def test_chunked_and_preempted_equal_hf(starcoder2) -> None:
    path, want, _ = starcoder2
    check_chunked(path, want)
    # 4 blocks of 16: a window and a step of 16 tokens fit (the blocks behind are freed), four
    # requests at once do not.
    llm = LLM(path, max_num_batched_tokens=16, **{**ARGS, "num_kv_blocks": 4})
    assert tokens(llm.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_float8_kv_cache_stays_close(starcoder2) -> None:
    path, _, llm = starcoder2
    fp8 = LLM(path, kv_cache_dtype="fp8", max_num_batched_tokens=64, **ARGS)
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_fp8_dynamic_stays_close(starcoder2) -> None:
    path, _, llm = starcoder2
    check_fp8_close(path, llm)


def test_a_gguf_file_equals_hf(tmp_path) -> None:
    """As llama.cpp's converter writes Starcoder2: LayerNorm weights and biases (output_norm's
    too), q/k rows in HF's order, c_fc / c_proj as ffn_up / ffn_down, the LayerNorm epsilon as
    attention.layer_norm_epsilon; no window (its converter writes none), tied embeddings."""
    import gguf

    source = str(tmp_path / "src")
    model = save_tiny_hf(source, "starcoder2", "Starcoder2ForCausalLM",
                         perturb=perturb_norms_and_biases, sliding_window=None,
                         norm_epsilon=1e-3)  # fmt: skip
    file = str(tmp_path / "starcoder2.gguf")
    write_gguf(file, source, gguf.MODEL_ARCH.STARCODER2, "starcoder2",
               extra=lambda writer: writer.add_layer_norm_eps(1e-3))  # fmt: skip
    from_gguf = LLM(file, max_num_batched_tokens=64, **ARGS)
    cfg = from_gguf.engine.executor.runner.model.config
    assert cfg.architecture == "starcoder2" and cfg.rms_norm_eps == 1e-3
    assert cfg.attention_bias and cfg.mlp_bias and cfg.tie_word_embeddings
    check_alone_and_batched(from_gguf, hf_tokens(model, PROMPTS))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(starcoder2) -> None:
    """Triton kernels with decode in CUDA graphs (each layer's window and soft-cap inside
    them) equal to HF in fp32; FP8 W8A8 with a float8 KV cache within float8's noise."""
    path, want, llm = starcoder2
    check_gpu(path, want, llm)
