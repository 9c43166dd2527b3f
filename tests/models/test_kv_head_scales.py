"""Per-(layer, KV head) KV-cache scales (the int8 cache's), folded into the weights: exact where
the cache is not int8, each head's keys and values in the cache divided by its own scale, and
a layer's largest scale where the block's shape takes no per-head one (a q/k norm after the
rows, quantized o_proj columns)."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM
from kiln.config import EngineConfig
from kiln.models.kv_scales import KVScaleFoldError, fold_kv_head_scales
from kiln.runtime.model_loader import load_model
from tests.conftest import assert_same_completions, build_tiny_hf_model
from tests.models.test_kv_scales import ARGS, GREEDY, PROMPTS, _model, _prefill

# Two layers, two KV heads each: scales that differ per head, per layer and between k and v.
SCALES = [([2.0**-3, 2.0**2], [2.0**4, 2.0**-1]), ([2.0**5, 1.0], [2.0**-2, 2.0**3])]


@pytest.mark.parametrize(
    ("variant", "quantization"),
    [("llama-gqa", "none"), ("qwen2-bias", "none"), ("llama-gqa", "fp8-dynamic")],
)
def test_folded_head_scales_change_nothing_in_an_unquantized_cache(variant, quantization, tmp_path):
    """Powers of two through the query rows and k rows (biases too), v rows and o_proj's
    columns (or, float8 o_proj, its rows at the layer's largest v scale): the same tokens and
    logprobs with an fp32 cache."""
    src = str(tmp_path / variant)
    build_tiny_hf_model(variant, src)
    want = LLM(src, quantization=quantization, **ARGS).generate(PROMPTS, GREEDY)
    llm = LLM(src, quantization=quantization, **ARGS)
    folded = fold_kv_head_scales(_model(llm), SCALES)
    assert_same_completions(llm.generate(PROMPTS, GREEDY), want, atol=1e-6)
    per_head_v = quantization == "none"
    assert folded == [(k, v if per_head_v else [max(v)] * 2) for k, v in SCALES]


def test_each_head_holds_its_keys_and_values_over_its_own_scale(tmp_path):
    src = str(tmp_path / "llama")
    build_tiny_hf_model("llama-gqa", src)
    config = EngineConfig(model=src)
    model = load_model(config, torch.device("cpu"), torch.float32).model
    want_hidden, want_caches = _prefill(model)
    fold_kv_head_scales(model, SCALES)
    hidden, caches = _prefill(model)
    for (k, v), (want_k, want_v), (ks, vs) in zip(caches, want_caches, SCALES):
        for h in range(2):
            assert torch.equal(k[:, :, h], want_k[:, :, h] / ks[h])
            assert torch.equal(v[:, :, h], want_v[:, :, h] / vs[h])
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)


def test_after_a_k_norm_the_keys_take_the_layers_largest_scale(tmp_path):
    """Qwen3's per-head k-norm would undo a row scale: keys take the layer's largest through
    the norm and the softmax scale; values stay per head."""
    from tests.models.test_qwen3 import save_tiny_qwen3

    save_tiny_qwen3(str(tmp_path))
    config = EngineConfig(model=str(tmp_path))
    model = load_model(config, torch.device("cpu"), torch.float32).model
    want_hidden, want_caches = _prefill(model)
    folded = fold_kv_head_scales(model, SCALES)
    hidden, caches = _prefill(model)
    for (k, v), (want_k, want_v), (ks, vs) in zip(caches, want_caches, SCALES):
        for h in range(2):
            assert torch.equal(k[:, :, h], want_k[:, :, h] / max(ks))
            assert torch.equal(v[:, :, h], want_v[:, :, h] / vs[h])
    assert folded == [([max(k)] * 2, v) for k, v in SCALES]
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)


def test_a_block_that_says_nowhere_to_fold_is_refused():
    from torch import nn

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].self_attn = nn.Linear(2, 2)
    with pytest.raises(KVScaleFoldError, match="layer 0: a Linear block does not say where"):
        fold_kv_head_scales(model, [([2.0], [2.0])])
