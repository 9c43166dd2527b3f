"""Each layer's window read from config.json as transformers reads it (4.x and 5.x files):
Mistral and Starcoder2 everywhere, Qwen2 from max_window_layers on, Gemma 2 alternating, Gemma
3 by sliding_window_pattern, explicit layer_types; and what is refused."""

from __future__ import annotations

import pytest

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig

SHAPE = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4,
             num_key_value_heads=2, num_hidden_layers=6)  # fmt: skip


def _windows(model_type: str, hf_class: str, **extra) -> tuple[list, int | None]:
    cfg = ModelConfig.from_hf_dict(
        {"architectures": [hf_class], "model_type": model_type, **SHAPE, **extra}
    )
    return [cfg.layer_window(i) for i in range(6)], cfg.kv_window


def test_window_on_every_layer() -> None:
    for model_type, hf_class in (
        ("mistral", "MistralForCausalLM"),
        ("starcoder2", "Starcoder2ForCausalLM"),
    ):
        assert _windows(model_type, hf_class, sliding_window=8) == ([8] * 6, 8)
        assert _windows(model_type, hf_class, sliding_window=None) == ([None] * 6, None)


def test_qwen2_windows_from_max_window_layers() -> None:
    q = ("qwen2", "Qwen2ForCausalLM")
    assert _windows(*q, sliding_window=8, use_sliding_window=False) == ([None] * 6, None)
    got = _windows(*q, sliding_window=8, use_sliding_window=True, max_window_layers=4)
    assert got == ([None] * 4 + [8] * 2, None)  # mixed: no block freeing
    got = _windows(*q, sliding_window=8, use_sliding_window=True, max_window_layers=0)
    assert got == ([8] * 6, 8)
    got = _windows(*q, sliding_window=8, use_sliding_window=True, max_window_layers=6)
    assert got == ([None] * 6, None)


def test_gemma_alternation() -> None:
    g2 = _windows("gemma2", "Gemma2ForCausalLM", sliding_window=8)
    assert g2 == ([8, None] * 3, None)
    g3 = _windows("gemma3_text", "Gemma3ForCausalLM", sliding_window=8)  # every 6th global
    assert g3 == ([8] * 5 + [None], None)
    g3 = _windows("gemma3_text", "Gemma3ForCausalLM", sliding_window=8, sliding_window_pattern=2)
    assert g3 == ([8, None] * 3, None)
    types = ["full_attention", "sliding_attention"] * 3  # explicit layer_types win
    g3 = _windows("gemma3_text", "Gemma3ForCausalLM", sliding_window=8, layer_types=types)
    assert g3 == ([None, 8] * 3, None)


def test_round_trip_keeps_the_layer_types() -> None:
    cfg = ModelConfig.from_hf_dict(
        {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **SHAPE,
         "sliding_window": 8, "use_sliding_window": True, "max_window_layers": 2}
    )  # fmt: skip
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg


@pytest.mark.parametrize(
    "extra",
    [
        {"sliding_window": 0},
        {"sliding_window": 8, "layer_types": ["sliding_attention"] * 5},  # 6 layers
        {"sliding_window": 8, "layer_types": ["chunked_attention"] * 6},
    ],
)
def test_refused(extra) -> None:
    with pytest.raises(ModelLoadError):
        _windows("gemma2", "Gemma2ForCausalLM", **extra)
