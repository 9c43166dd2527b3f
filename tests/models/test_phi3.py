"""Phi-3 / Phi-4 on the model plug-in, against Hugging Face in fp32: the checkpoint's fused
qkv_proj and gate_up_proj, longrope (the 51-token prompt past original_max_position_embeddings
rotates by the long factors, the 17-token one crosses it while decoding), partial rotary
(Phi-4-mini's 0.75, here 0.5) and a sliding window as wide as the context; greedy tokens equal
over 32 new tokens alone, batched, chunked and prefix-cached; FP8 weights within float8's
noise; each tensor rank's cut of the fused tensors."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from tests.models.family_checks import (
    check_alone_and_batched,
    check_chunked,
    check_fp8_close,
    check_gpu,
    check_prefix_hit,
    hf_tokens,
    perturb_norms_and_biases,
    save_tiny_hf,
    write_gguf,
)
from tests.models.test_qwen3 import ARGS, PREFIXED, PROMPTS

HALF_ROTARY = 16 // 2 // 2  # head_dim 16, partial_rotary_factor 0.5: 4 frequencies


def phi3_config(original: int) -> dict:
    return dict(
        partial_rotary_factor=0.5,
        max_position_embeddings=256,
        original_max_position_embeddings=original,
        sliding_window=256,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.2, 1.5, 2.0][:HALF_ROTARY],
            "long_factor": [1.5, 3.0, 6.0, 12.0][:HALF_ROTARY],
            "original_max_position_embeddings": original,
        },
    )


# transformers' Phi-3 recomputes a sequence's cache with the long factors when decoding crosses
# original_max_position_embeddings; kiln (as vLLM) keeps the keys it cached (docs/limits.md).
# So each checkpoint here is run on prompts that never cross it while decoding: with 16, the
# prompts of 17 tokens and more rotate by the long factors from their first token; with 48,
# those of at most 17 stay on the short ones (and may be prefilled in chunks). A batch's prompts
# fit one step's token budget (64): a prompt prefilled in chunks rotates each chunk by the
# length it has reached (kiln.layers.rotary.StepRope).
LONG = [PROMPTS[3], PREFIXED[0]]
WITHIN = [PROMPTS[0], PROMPTS[1], PROMPTS[3]]


def _phi3(tmp_path_factory, original: int, prompts: list[list[int]]) -> tuple[str, dict, LLM]:
    path = str(tmp_path_factory.mktemp(f"phi3-{original}") / "src")
    model = save_tiny_hf(path, "phi3", "Phi3ForCausalLM", perturb=perturb_norms_and_biases,
                         pad_token_id=0, **phi3_config(original))  # fmt: skip
    return path, hf_tokens(model, prompts), LLM(path, max_num_batched_tokens=64, **ARGS)


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> tuple[str, dict, LLM]:
    return _phi3(tmp_path_factory, 16, [*LONG, *PREFIXED])


@pytest.fixture(scope="module")
def phi3_short(tmp_path_factory) -> tuple[str, dict, LLM]:
    return _phi3(tmp_path_factory, 48, WITHIN)


def test_long_factors_batched_alone_and_prefix_cached_equal_hf(phi3) -> None:
    _, want, llm = phi3
    model = llm.engine.executor.runner.model
    assert model.config.rotary_dim == 8 and model.step_rope is not None
    check_alone_and_batched(llm, want, LONG)
    check_prefix_hit(llm, want)


def test_short_factors_batched_alone_and_chunked_equal_hf(phi3_short) -> None:
    path, want, llm = phi3_short
    check_alone_and_batched(llm, want, WITHIN)
    check_chunked(path, want, WITHIN)


def test_fp8_dynamic_stays_close(phi3) -> None:
    path, _, llm = phi3
    check_fp8_close(path, llm)


def test_each_tensor_rank_holds_its_cut_of_the_fused_tensors(phi3) -> None:
    from kiln.config import EngineConfig
    from kiln.distributed.parallel_state import ParallelContext, RankLayout
    from kiln.runtime.model_loader import load_model

    path = phi3[0]
    cpu, fp32 = torch.device("cpu"), torch.float32
    whole = dict(load_model(EngineConfig(model=path), cpu, fp32).model.named_parameters())
    for rank in range(2):
        ctx = ParallelContext(RankLayout(2, 1, rank), None, None, None)
        part = load_model(EngineConfig(model=path, tensor_parallel_size=2), cpu, fp32, ctx)
        got = dict(part.model.named_parameters())
        n = part.model.layers[0].mlp.intermediate_size
        gate_up = whole["layers.0.mlp.gate_up_proj.weight"]
        want = torch.cat([gate_up[rank * n : (rank + 1) * n], gate_up[2 * n + rank * n :][:n]])
        assert torch.equal(got["layers.0.mlp.gate_up_proj.weight"], want)


def test_a_gguf_file_equals_hf(tmp_path) -> None:
    """As llama.cpp's converter writes Phi-3 (plain rotary: the 4k models): qkv_proj as
    attn_qkv, gate_up_proj as ffn_up, in HF's row order."""
    import gguf

    source = str(tmp_path / "src")
    model = save_tiny_hf(source, "phi3", "Phi3ForCausalLM", perturb=perturb_norms_and_biases,
                         pad_token_id=0, sliding_window=None)  # fmt: skip
    file = str(tmp_path / "phi3.gguf")
    write_gguf(file, source, gguf.MODEL_ARCH.PHI3, "phi3")
    from_gguf = LLM(file, max_num_batched_tokens=64, **ARGS)
    assert from_gguf.engine.executor.runner.model.config.architecture == "phi3"
    check_alone_and_batched(from_gguf, hf_tokens(model, PROMPTS), PROMPTS)


def test_a_longrope_gguf_file_equals_hf(phi3, tmp_path) -> None:
    """As llama.cpp's converter writes Phi-3 128k: the longrope factors as the tensors
    rope_factors_long / rope_factors_short, the original context and the attention factor as
    metadata, the partial rotary's dims as rope.dimension_count."""
    import math

    import gguf
    import numpy as np

    path, want, _ = phi3
    config = phi3_config(16)

    def metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_rope_dimension_count(2 * HALF_ROTARY)
        writer.add_rope_scaling_orig_ctx_len(16)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(256 / 16) / math.log(16)))
        writer.add_sliding_window(config["sliding_window"])
        rope = config["rope_parameters"]
        for name in ("long", "short"):
            factors = np.array(rope[f"{name}_factor"], dtype=np.float32)
            writer.add_tensor(f"rope_factors_{name}.weight", factors)

    file = str(tmp_path / "phi3-longrope.gguf")
    write_gguf(file, path, gguf.MODEL_ARCH.PHI3, "phi3", extra=metadata)
    from_gguf = LLM(file, max_num_batched_tokens=64, **ARGS)
    cfg = from_gguf.engine.executor.runner.model.config
    assert cfg.rotary_dim == 8 and cfg.rope_scaling["rope_type"] == "longrope"
    check_alone_and_batched(from_gguf, want, LONG)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_graphs_and_fp8(phi3) -> None:
    path, want, llm = phi3[:3]
    check_gpu(path, want, llm, LONG)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_short_factors(phi3_short) -> None:
    path, want, llm = phi3_short[:3]
    check_gpu(path, want, llm, WITHIN)
