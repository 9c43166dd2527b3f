"""Llama checkpoints beyond the plain shape, against Hugging Face in fp32: q/k/v/o and MLP biases
(`attention_bias`, `mlp_bias`: Granite-style fine-tunes), and the rotary scalings yarn and
dynamic NTK (past max_position_embeddings, where dynamic grows its base per sequence length
as transformers does). The rotary tables themselves are checked against transformers' own."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.layers.rotary import rope_inv_freq
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

# Long enough for dynamic NTK to grow: 51-token prompt + 32 new tokens pass 64 positions.
LONG = dict(max_model_len=256)
VARIANTS = {
    "bias": dict(attention_bias=True, mlp_bias=True),
    "yarn": dict(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "dynamic": dict(
        max_position_embeddings=64,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory) -> tuple[str, str, dict, LLM]:
    name = request.param
    path = str(tmp_path_factory.mktemp(f"llama-{name}") / "src")
    model = save_tiny_hf(path, "llama", "LlamaForCausalLM", perturb=perturb_norms_and_biases,
                         **VARIANTS[name])  # fmt: skip
    want = hf_tokens(model, [*PROMPTS, *PREFIXED])
    llm = LLM(path, max_num_batched_tokens=64, **{**ARGS, **LONG})
    return name, path, want, llm


def test_batched_and_alone_equal_hf(variant) -> None:
    _, _, want, llm = variant
    check_alone_and_batched(llm, want)


def test_chunked_and_prefix_cached_equal_hf(variant) -> None:
    name, path, want, llm = variant
    check_prefix_hit(llm, want)
    if name != "dynamic":  # dynamic NTK: a chunk rotates by the length it reached (see StepRope)
        check_chunked(path, want, **LONG)


def test_fp8_dynamic_stays_close(variant) -> None:
    name, path, _, llm = variant
    if name == "bias":
        check_fp8_close(path, llm, **LONG)


def test_biases_are_loaded(variant) -> None:
    name, _, _, llm = variant
    if name != "bias":
        return
    layer = llm.engine.executor.runner.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    assert layer.mlp.gate_up_proj.bias.abs().max() > 0


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
         "beta_fast": 32, "beta_slow": 1},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048,
         "mscale": 1.0, "mscale_all_dim": 0.5, "truncate": False},
        {"rope_type": "longrope", "original_max_position_embeddings": 4096,
         "short_factor": [1.0 + i / 64 for i in range(32)],
         "long_factor": [2.0 + i / 16 for i in range(32)]},
    ],
)  # fmt: skip
def test_rope_tables_equal_transformers(rope: dict) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kiln.layers.rotary import attention_factor

    config = LlamaConfig(hidden_size=512, num_attention_heads=8, max_position_embeddings=16384,
                         rope_parameters={**rope, "rope_theta": 10000.0})  # fmt: skip
    init = ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    for seq_len in (None, 16384):
        want, factor = init(config, None, seq_len=seq_len)
        got = rope_inv_freq(64, 10000.0, rope, 16384, seq_len)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
        assert attention_factor(rope, 16384) == pytest.approx(factor)
