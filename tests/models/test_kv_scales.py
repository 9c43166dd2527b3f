"""Per-layer float8 KV-cache scales, folded into the weights: exact where the cache is not
float8, and a float8 cache that holds keys past e4m3's 448 where the unscaled one saturates."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.builder.calibrate.kv_scales import calibrate_kv_scales, power_of_two_scale
from kiln.models.kv_scales import fold_kv_scales
from tests.conftest import assert_same_completions, build_tiny_hf_model, generated_logprob_gaps

PROMPTS = [[1, 5, 9, 33, 7, 80, 12], [1, 200, 3, 17]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, ignore_eos=True)
ARGS = dict(kv_cache_memory_gb=0.05, max_num_seqs=4, enable_prefix_caching=False)


def _model(llm: LLM):
    return llm.engine.executor.runner.model


def test_power_of_two_scales():
    assert power_of_two_scale(448.0) == 1.0
    assert power_of_two_scale(449.0) == 2.0
    assert power_of_two_scale(3.0) == 2.0**-7  # 3 / 2^-7 = 384 <= 448 < 768
    assert power_of_two_scale(0.0) == 1.0


@pytest.mark.parametrize(
    ("variant", "quantization"), [("qwen2-bias", "none"), ("llama-gqa", "fp8-dynamic")]
)
def test_folded_scales_change_nothing_in_an_unquantized_cache(variant, quantization, tmp_path):
    """Power-of-two scales folded into qkv (bias included), o_proj and the softmax scale: the
    same tokens and logprobs with an fp32 cache, for fp32 weights and float8 ones (whose
    per-channel weight scales take them)."""
    src = str(tmp_path / variant)
    build_tiny_hf_model(variant, src)
    want = LLM(src, quantization=quantization, **ARGS).generate(PROMPTS, GREEDY)
    llm = LLM(src, quantization=quantization, **ARGS)
    fold_kv_scales(_model(llm), [(2.0**-3, 2.0**4), (2.0**5, 2.0**-2)])
    assert_same_completions(llm.generate(PROMPTS, GREEDY), want, atol=1e-6)


def test_a_scaled_float8_cache_holds_keys_that_saturate_an_unscaled_one(tmp_path):
    src = str(tmp_path / "big-keys")
    hf = build_tiny_hf_model("llama-gqa", src)
    with torch.no_grad():  # keys of magnitude ~1e3-1e4: past e4m3's 448
        for layer in hf.model.layers:
            layer.self_attn.k_proj.weight.mul_(400.0)
            layer.self_attn.q_proj.weight.div_(400.0)  # q.k unchanged: the same model's logits
    hf.save_pretrained(src)
    want = LLM(src, **ARGS).generate(PROMPTS, GREEDY)  # fp32 cache: the reference
    unscaled = LLM(src, kv_cache_dtype="fp8", **ARGS)
    scaled = LLM(src, kv_cache_dtype="fp8", **ARGS)
    one_token = SamplingParams(max_tokens=1, temperature=0.0)
    calibration = [list(range(3, 60)), list(range(100, 170))]
    scales = calibrate_kv_scales(
        _model(scaled), calibration, lambda b: scaled.generate(b, one_token)
    )
    assert all(k > 1.0 for k, _ in scales)  # keys past 448 need a scale above one
    fold_kv_scales(_model(scaled), scales)
    gap_unscaled = generated_logprob_gaps(unscaled.generate(PROMPTS, GREEDY), want).max()
    gap_scaled = generated_logprob_gaps(scaled.generate(PROMPTS, GREEDY), want).max()
    assert gap_scaled < 0.1 < gap_unscaled, (gap_scaled, gap_unscaled)


def _prefill(model) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """(final hidden states, each layer's fp32 K and V cache) of PROMPTS as one prefill."""
    from kiln.attention.backend import get_attention_backend
    from kiln.kernels import reference
    from kiln.models.packed_prefill import packed_prefill_metadata

    metadata, blocks = packed_prefill_metadata([len(p) for p in PROMPTS], 16, "cpu")
    cfg = model.config
    shape = (blocks, 16, cfg.num_key_value_heads, cfg.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in model.layers]
    ids = torch.tensor([t for p in PROMPTS for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in PROMPTS])
    backend = get_attention_backend("torch", torch.device("cpu"))
    with torch.no_grad():
        hidden = model(reference, backend, ids, positions, caches, metadata)
    return hidden, caches


def test_a_key_scale_after_a_k_norm_folds_into_the_norm(tmp_path):
    """Qwen3 RMS-normalises each key head after k_proj: a k_scale folded into k_proj's rows (the
    fold a Llama block takes) is undone by the norm, so the cache would hold k, not k / k_scale,
    while the softmax scale still multiplies by k_scale: a silently wrong model. The block folds
    it into the norm's weight instead (RMSNorm(k) * w / s; rotary commutes with a scalar): the
    cache holds k / k_scale exactly (powers of two) and the layer computes what it did."""
    from kiln.config import EngineConfig
    from kiln.runtime.model_loader import load_model
    from tests.models.test_qwen3 import save_tiny_qwen3

    save_tiny_qwen3(str(tmp_path))
    config = EngineConfig(model=str(tmp_path))
    model = load_model(config, torch.device("cpu"), torch.float32).model
    want_hidden, want_caches = _prefill(model)
    scales = [(8.0, 4.0), (2.0**-3, 2.0)]
    fold_kv_scales(model, scales)
    hidden, caches = _prefill(model)
    for (k, v), (want_k, want_v), (k_scale, v_scale) in zip(caches, want_caches, scales):
        assert torch.equal(k, want_k / k_scale) and torch.equal(v, want_v / v_scale)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)

    # The Llama fold on this block: the norm gives the keys back unscaled (but for its eps).
    rows_only = load_model(config, torch.device("cpu"), torch.float32).model
    for layer, (k_scale, _) in zip(rows_only.layers, scales):
        attn = layer.self_attn
        attn.qkv_proj.scale_output_rows(slice(attn.q_size, attn.q_size + attn.kv_size), 1 / k_scale)
    _, caches = _prefill(rows_only)
    for (k, _), (want_k, _), (k_scale, _) in zip(caches, want_caches, scales):
        torch.testing.assert_close(k, want_k, rtol=1e-2, atol=1e-3)
        assert not torch.allclose(k, want_k / k_scale, rtol=0.5)


def test_a_block_that_says_nowhere_to_fold_is_refused():
    from torch import nn

    from kiln.models.kv_scales import KVScaleFoldError

    model = nn.Module()
    model.layers = nn.ModuleList([nn.Module()])
    model.layers[0].self_attn = nn.Linear(2, 2)  # a block with no fold_kv_scales
    with pytest.raises(KVScaleFoldError, match="layer 0: a Linear block does not say where"):
        fold_kv_scales(model, [(2.0, 2.0)])
