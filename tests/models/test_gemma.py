"""Gemma on the model plug-in, against Hugging Face in fp32: (1 + w) norms, the sqrt(hidden)
embedding scale, GeGLU, head_dim 32 != hidden / heads, tied embeddings; greedy tokens equal
over 32 new tokens alone, batched, chunked, prefix-cached
and preempted; FP8 weights within float8's noise;
a `kiln build` engine directory. The sandwich norms Gemma 2/3 use (with query_pre_attn_scalar
and the final logit soft-cap) are checked on a Gemma 2 checkpoint without attention soft-capping
and with a window wider than the context, loaded as the shared Gemma model with
norms="sandwich" (Gemma 2 itself, with its windows, registers elsewhere)."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.models import registry
from kiln.models.gemma import (
    QK_NORM_SANDWICH_LAYER_TENSOR_MAP,
    SANDWICH_LAYER_TENSOR_MAP,
    GemmaForCausalLM,
)
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_fp8_close,
    check_gpu,
    check_preempted,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
    write_gguf,
)
from tests.models.test_models_vs_hf import assert_greedy_matches_hf
from tests.models.test_qwen3 import ARGS, GREEDY, PREFIXED, PROMPTS

GEMMA = dict(head_dim=32, hidden_act="gelu_pytorch_tanh")


@pytest.fixture(scope="module")
def gemma(tmp_path_factory) -> tuple[str, dict, LLM]:
    path = str(tmp_path_factory.mktemp("gemma") / "src")
    model = save_tiny_hf(path, "gemma", "GemmaForCausalLM", perturb=perturb_norms_and_biases,
                         **GEMMA)  # fmt: skip
    assert model.config.tie_word_embeddings
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    return path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_batched_and_alone_equal_hf(gemma) -> None:
    _, want, llm = gemma
    model = llm.engine.executor.runner.model
    assert model.lm_head is None and model.embedding_multiplier == pytest.approx(8.0)
    assert model.layers[0].mlp.activation == "gelu_pytorch_tanh"
    check_alone_and_batched(llm, want)


def test_chunked_prefix_cached_and_preempted_equal_hf(gemma) -> None:
    path, want, llm = gemma
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    check_preempted(path, want)


def test_fp8_dynamic_stays_close(gemma) -> None:
    path, _, llm = gemma
    check_fp8_close(path, llm)


def test_an_fp8_build_loads_and_stays_close(gemma, tmp_path) -> None:
    """`kiln build --quantization fp8`: calibration runs the Gemma layers (scaled embedding,
    folded norms); the engine directory loads with the norms as built (no second +1)."""
    from kiln.builder.build import BuildOptions, build_engine

    path, _, llm = gemma
    out = str(tmp_path / "fp8")
    options = BuildOptions(
        dtype="float32", quantization="fp8", accuracy_check=False, max_model_len=256
    )
    manifest = build_engine(path, out, options, None)
    assert manifest.quantization == "fp8"
    engine = LLM(out, max_num_batched_tokens=64, **ARGS)
    norm = engine.engine.executor.runner.model.norm
    assert torch.allclose(norm.float(), llm.engine.executor.runner.model.norm.float())
    gaps = generated_logprob_gaps(engine.generate(PROMPTS, GREEDY), llm.generate(PROMPTS, GREEDY))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps


def test_a_gguf_file_equals_hf(gemma, tmp_path) -> None:
    """As llama.cpp's converter writes Gemma: its names, q/k rows in HF's order, every norm
    weight with 1 added, no output tensor (tied)."""
    import gguf

    path, want, _ = gemma
    file = str(tmp_path / "gemma.gguf")

    def converted(name: str, tensor: torch.Tensor) -> torch.Tensor | None:
        if name == "lm_head.weight":
            return None
        return tensor + 1 if name.endswith("norm.weight") else tensor

    write_gguf(file, path, gguf.MODEL_ARCH.GEMMA, "gemma", converted)
    from_gguf = LLM(file, max_num_batched_tokens=64, **ARGS)
    model = from_gguf.engine.executor.runner.model
    assert model.config.architecture == "gemma" and model.config.hidden_act == "gelu_pytorch_tanh"
    check_alone_and_batched(from_gguf, want)


class SandwichGemma(GemmaForCausalLM):
    """Gemma's model with Gemma 2's sandwich norms: what a Gemma 2/3 file builds on."""

    layer_tensor_map = SANDWICH_LAYER_TENSOR_MAP
    norms = "sandwich"


@pytest.fixture(scope="module")
def sandwich(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        family = registry.Family("gemma2", __name__, "SandwichGemma")
        patch.setitem(registry.FAMILIES, "Gemma2ForCausalLM", family)
        patch.setitem(registry._BY_ARCHITECTURE, "gemma2", ("Gemma2ForCausalLM", family))
        path = str(tmp_path_factory.mktemp("gemma2") / "src")
        model = save_tiny_hf(
            path, "gemma2", "Gemma2ForCausalLM", perturb=perturb_norms_and_biases,
            attn_logit_softcapping=None, final_logit_softcapping=3.0, query_pre_attn_scalar=24,
            sliding_window=4096, **GEMMA,
        )  # fmt: skip
        want = hf_tokens(model, [*PROMPTS, *PREFIXED])
        yield path, want, LLM(path, max_num_batched_tokens=64, **ARGS), model


def test_sandwich_norms_equal_hf(sandwich) -> None:
    path, want, llm, hf_model = sandwich
    model = llm.engine.executor.runner.model
    layer = model.layers[0]
    assert layer.norms == "sandwich" and layer.pre_feedforward_layernorm is not None
    assert layer.self_attn.scale == pytest.approx(24**-0.5)
    assert model.config.final_logit_softcapping == 3.0
    check_alone_and_batched(llm, want)
    check_prefix_hit(llm, want)
    check_chunked(path, want)
    # The soft-cap keeps the argmax: the logprobs show it.
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    out = llm.generate(PROMPTS[0], params)[0].outputs[0]
    assert_greedy_matches_hf(hf_model, PROMPTS[0], out, 1e-4, "gemma2 sandwich")


def test_smoothing_is_refused(gemma, tmp_path) -> None:
    """SmoothQuant would divide w of a (1 + w) norm: refused, not built wrong."""
    from kiln.builder.build import BuildOptions, build_engine

    options = BuildOptions(dtype="float32", quantization="fp8", smoothing="smoothquant",
                           accuracy_check=False, max_model_len=256)  # fmt: skip
    with pytest.raises(ValueError, match="smoothing folds into Llama-shaped"):
        build_engine(gemma[0], str(tmp_path / "smoothed"), options, None)


class LocalRopeGemma(SandwichGemma):
    """Gemma 3's text layers without windows: per-head (1 + w) q/k norms, and layer 0 (a
    sliding layer of the checkpoint, its window wider than the context) rotating by the local
    base through the per-layer rope table API."""

    layer_tensor_map = QK_NORM_SANDWICH_LAYER_TENSOR_MAP
    qk_norm = True

    def make_layer(self, cfg, prefix, method, dtype, ctx, full):
        from kiln.models.blocks import DecoderLayer

        table = "local" if prefix == "layers.0" else None
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full, True, "sandwich", table)


@pytest.fixture(scope="module")
def local_rope(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        family = registry.Family("gemma3_text", __name__, "LocalRopeGemma")
        patch.setitem(registry.FAMILIES, "Gemma3ForCausalLM", family)
        patch.setitem(registry._BY_ARCHITECTURE, "gemma3_text", ("Gemma3ForCausalLM", family))
        path = str(tmp_path_factory.mktemp("gemma3") / "src")
        model = save_tiny_hf(
            path, "gemma3_text", "Gemma3ForCausalLM", perturb=perturb_norms_and_biases,
            layer_types=["sliding_attention", "full_attention"], rope_theta=1e6,
            rope_local_base_freq=100.0, query_pre_attn_scalar=32, sliding_window=4096, **GEMMA,
        )  # fmt: skip
        want = hf_tokens(model, PROMPTS)
        yield path, want, LLM(path, max_num_batched_tokens=64, **ARGS)


def test_per_layer_rope_bases_equal_hf(local_rope) -> None:
    path, want, llm = local_rope
    model = llm.engine.executor.runner.model
    assert model.config.rope_local_base_freq == 100.0 and model.config.rope_theta == 1e6
    assert model.layers[0].self_attn.rope_table == "local" and "local" in model.rope_tables
    check_alone_and_batched(llm, want)
    check_chunked(path, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(gemma) -> None:
    path, want, llm = gemma[:3]
    check_gpu(path, want, llm, PROMPTS)
