"""Per-layer float8 KV-cache scales, folded into the weights: exact where the cache is not
float8, and a float8 cache that holds keys past e4m3's 448 where the unscaled one saturates."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.quantization.kv_scales import calibrate_kv_scales, fold_kv_scales, power_of_two_scale
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
