"""The block options of each new family read from config.json and written back: a config
transformers' own class makes parses, its to_hf_dict is accepted by that class, and reading
that back gives the same ModelConfig (an engine directory's config round-trips)."""

from __future__ import annotations

import pytest
import transformers

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig

SMALL = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
CASES = {
    "gemma": (transformers.GemmaConfig, dict(head_dim=32, hidden_act="gelu_pytorch_tanh")),
    "granite": (transformers.GraniteConfig, dict(embedding_multiplier=12.0, logits_scaling=8.0,
                                                 residual_multiplier=0.22, attention_multiplier=0.1,
                                                 attention_bias=True, mlp_bias=True)),
    "phi3": (transformers.Phi3Config, dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=64,
        max_position_embeddings=256, sliding_window=None,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": [1.0] * 6, "long_factor": [2.0] * 6},
    )),
    "olmo2": (transformers.Olmo2Config, {}),
    "stablelm": (transformers.StableLmConfig, dict(partial_rotary_factor=0.25, use_qkv_bias=True,
                                                   use_parallel_residual=True)),
    "cohere": (transformers.CohereConfig, dict(logit_scale=0.0625, attention_bias=True)),
}  # fmt: skip
WANT = {
    "gemma": dict(embedding_multiplier=8.0, tie_word_embeddings=True),
    "granite": dict(embedding_multiplier=12.0, logits_multiplier=0.125, residual_multiplier=0.22,
                    attention_multiplier=0.1, mlp_bias=True, o_proj_bias=True),
    "phi3": dict(rotary_dim=12, partial_rotary_factor=0.75),
    "olmo2": dict(o_proj_bias=False),
    "stablelm": dict(rotary_dim=4, attention_bias=True, parallel_residual=True, o_proj_bias=False),
    "cohere": dict(logits_multiplier=0.0625, parallel_residual=True, tie_word_embeddings=True),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(CASES))
def test_family_fields_read_and_round_trip(family: str) -> None:
    config_class, extra = CASES[family]
    hf = config_class(**SMALL, **extra).to_dict()
    cfg = ModelConfig.from_hf_dict(hf)
    assert cfg.architecture == family
    for name, value in WANT[family].items():
        assert getattr(cfg, name) == value, name
    again = config_class(**cfg.to_hf_dict()).to_dict()
    assert ModelConfig.from_hf_dict(again) == cfg
    if family == "phi3":
        assert cfg.rope_scaling is not None
        assert cfg.rope_scaling["original_max_position_embeddings"] == 64


def test_activations_read_as_transformers_reads_them() -> None:
    """Gemma's legacy "gelu" is the tanh approximation (transformers says so); elsewhere an
    activation without kernels is refused by name."""
    gemma = {**SMALL, "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"}
    assert ModelConfig.from_hf_dict(gemma).hidden_act == "gelu_pytorch_tanh"
    llama = {**SMALL, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"}
    with pytest.raises(ModelLoadError, match="hidden_act='gelu'"):
        ModelConfig.from_hf_dict(llama)
