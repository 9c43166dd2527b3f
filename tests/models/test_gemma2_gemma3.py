"""Gemma 2 and Gemma 3 (text) against Hugging Face in fp32 (eager attention), prompts longer
than the window: local (sliding-window) and global layers alternating, Gemma 2's attention and
final logit soft-caps, Gemma 3's per-head (1 + w) q/k norms and its local layers' rotary base;
greedy tokens equal over 32 new tokens alone, batched, chunked, preempted and prefix-cached."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.attention.backend import AttentionKind
from kiln.kv_cache.hybrid import HybridKVCacheManager
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

GEMMA = dict(head_dim=32, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=24)
VARIANTS = {
    # Layers 0 and 2 local (a window of 5), 1 and 3 global; caps that bite at this scale.
    "gemma2": (
        "gemma2", "Gemma2ForCausalLM",
        dict(num_hidden_layers=4, sliding_window=5, attn_logit_softcapping=0.5,
             final_logit_softcapping=3.0, **GEMMA),
    ),
    # Two local layers (window 7, base 10k) to one global (base 1M, linear scaling x2).
    "gemma3": (
        "gemma3_text", "Gemma3ForCausalLM",
        dict(num_hidden_layers=3, sliding_window=7, sliding_window_pattern=3,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
             }, **GEMMA),
    ),
}  # fmt: skip


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def gemma(request, tmp_path_factory):
    model_type, hf_class, overrides = VARIANTS[request.param]
    path = str(tmp_path_factory.mktemp(request.param) / "src")
    model = save_tiny_hf(path, model_type, hf_class, perturb=perturb_norms_and_biases, **overrides)
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return request.param, path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_layer_kinds(gemma) -> None:
    variant, _, _, llm = gemma
    model = llm.engine.executor.runner.model
    kinds = [layer.self_attn.kind for layer in model.layers]
    if variant == "gemma2":
        local, full = AttentionKind(5, 0.5), AttentionKind(None, 0.5)
        assert kinds == [local, full, local, full]
        assert model.config.final_logit_softcapping == 3.0
    else:
        assert kinds == [AttentionKind(7), AttentionKind(7), AttentionKind(None)]
        assert model.config.rope_local_base_freq == 1e4 and model.config.rope_theta == 1e6
        assert [layer.self_attn.rope_table for layer in model.layers] == ["local", "local", None]
    assert model.layers[0].self_attn.scale == pytest.approx(24**-0.5)
    # Local and global layers: a block table per KV cache group (kiln.models.kv_groups), the
    # windowed ones giving back the blocks behind their window.
    kv = llm.engine.kv_cache
    assert isinstance(kv, HybridKVCacheManager) and kv.sliding_window is None
    windows = [g.sliding_window for g in kv.groups]
    assert windows == ([None, 5] if variant == "gemma2" else [None, 7, 7])


def test_batched_alone_and_prefix_cached_equal_hf(gemma) -> None:
    _, _, want, llm = gemma
    check_alone_and_batched(llm, want)
    check_prefix_hit(llm, want)


def test_chunked_equal_hf(gemma) -> None:
    _, path, want, _ = gemma
    check_chunked(path, want)  # chunks of 16 past windows of 5 and 7


def test_preempted_equal_hf(gemma) -> None:
    _, path, want, source = gemma
    # 6 blocks of 16 in each KV cache group hold the longest request (51 + 32 tokens: 6
    # blocks; a windowed group holds them all while the prompt runs), not all four.
    num_blocks = 6 * len(source.engine.kv_cache.groups)
    llm = LLM(path, max_num_batched_tokens=64, **{**ARGS, "num_kv_blocks": num_blocks})
    assert tokens(llm.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_engine_directory_keeps_the_layer_kinds(gemma, tmp_path) -> None:
    """`kiln build` writes the layer kinds, soft-caps and rotary bases into the engine
    directory's config; the directory loads into the same model and tokens."""
    from kiln.builder.build import BuildOptions, build_engine

    _, path, want, _ = gemma
    out = str(tmp_path / "engine")
    build_engine(
        path, out, BuildOptions(dtype="float32", quantization="none", accuracy_check=False), None
    )
    built = LLM(out, max_num_batched_tokens=64, **ARGS)
    model = built.engine.executor.runner.model
    source = LLM(path, max_num_batched_tokens=64, **ARGS).engine.executor.runner.model
    assert model.config == source.config
    assert [layer.self_attn.kind for layer in model.layers] == [
        layer.self_attn.kind for layer in source.layers
    ]
    assert tokens(built.generate(PROMPTS, GREEDY)) == [want[tuple(p)] for p in PROMPTS]


def test_float8_kv_cache_stays_close(gemma) -> None:
    """A float8 KV cache (unscaled e4m3) through the windowed and soft-capped layers: the
    logprobs of the fp32 cache's run within float8's noise."""
    _, path, _, llm = gemma
    fp8 = LLM(path, kv_cache_dtype="fp8", max_num_batched_tokens=64, **ARGS)
    gaps = generated_logprob_gaps(fp8.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_fp8_dynamic_stays_close(gemma) -> None:
    _, path, _, llm = gemma
    check_fp8_close(path, llm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(gemma) -> None:
    """Triton kernels with decode in CUDA graphs (each layer's window and soft-cap inside
    them) equal to HF in fp32; FP8 W8A8 with a float8 KV cache within float8's noise."""
    _, path, want, llm = gemma
    check_gpu(path, want, llm)


# As llama.cpp's converter and runtime take them: Gemma 2's layers alternate, Gemma 3's run
# five local to one global with the local base at 10000; the query scale is head_dim's.
GGUF_VARIANTS = {
    "gemma2": (
        "gemma2", "Gemma2ForCausalLM",
        dict(num_hidden_layers=4, sliding_window=5, attn_logit_softcapping=0.5,
             final_logit_softcapping=3.0, head_dim=32, hidden_act="gelu_pytorch_tanh",
             query_pre_attn_scalar=32),
    ),
    "gemma3": (
        "gemma3_text", "Gemma3ForCausalLM",
        dict(num_hidden_layers=6, sliding_window=7,
             rope_parameters={
                 "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                 "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
             }, head_dim=32, hidden_act="gelu_pytorch_tanh", query_pre_attn_scalar=32),
    ),
}  # fmt: skip


@pytest.mark.parametrize("variant", sorted(GGUF_VARIANTS))
def test_a_gguf_file_equals_hf(variant, tmp_path) -> None:
    """As llama.cpp's converter writes Gemma 2 / Gemma 3: its names (post_attention_norm,
    ffn_norm before the MLP, post_ffw_norm, attn_q_norm / attn_k_norm), every norm weight with
    1 added, no output tensor; the window, soft-caps and global rope scaling as metadata."""
    import gguf

    model_type, hf_class, overrides = GGUF_VARIANTS[variant]
    source = str(tmp_path / "src")
    model = save_tiny_hf(source, model_type, hf_class, perturb=perturb_norms_and_biases,
                         **overrides)  # fmt: skip
    want = hf_tokens(model, PROMPTS)

    def converted(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if name == "lm_head.weight":
            return None
        return tensor + 1 if name.endswith("norm.weight") else tensor

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_sliding_window(overrides["sliding_window"])
        if variant == "gemma2":
            writer.add_attn_logit_softcapping(0.5)
            writer.add_final_logit_softcapping(3.0)
        else:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(2.0)

    file = str(tmp_path / f"{variant}.gguf")
    arch = gguf.MODEL_ARCH.GEMMA2 if variant == "gemma2" else gguf.MODEL_ARCH.GEMMA3
    write_gguf(file, source, arch, variant, converted, metadata)
    from_gguf = LLM(file, max_num_batched_tokens=64, **ARGS)
    got = from_gguf.engine.executor.runner.model
    want_config = LLM(source, max_num_batched_tokens=64, **ARGS).engine.executor.runner.model
    kinds = [layer.self_attn.kind for layer in got.layers]
    assert kinds == [layer.self_attn.kind for layer in want_config.layers]
    assert got.config.layer_types == want_config.config.layer_types
    assert got.config.final_logit_softcapping == want_config.config.final_logit_softcapping
    assert got.config.rope_local_base_freq == want_config.config.rope_local_base_freq
    assert got.config.rope_scaling == want_config.config.rope_scaling
    check_alone_and_batched(from_gguf, want)


def test_gguf_query_scale_follows_llama_cpp() -> None:
    """Gemma 2/3 GGUF files store no query_pre_attn_scalar: head_dim's (9B, 12B), hidden /
    heads for the 27B models (Gemma 2's 46 layers: 144, Gemma 3's 62: 168), as llama.cpp."""
    from kiln.models.gemma import gguf_query_scalar

    def scalar(layers: int, hidden: int, heads: int, head_dim: int) -> int:
        shape = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                     head_dim=head_dim)  # fmt: skip
        return gguf_query_scalar(shape)["query_pre_attn_scalar"]

    assert scalar(42, 3584, 16, 256) == 256 and scalar(48, 3840, 16, 256) == 256
    assert scalar(46, 4608, 32, 128) == 144 and scalar(62, 5376, 32, 128) == 168
