"""`kiln build --kv-cache-dtype int8`: per-(layer, KV head) scales measured over the calibration
text, stored in the manifest and folded into the weights; the engine runs an int8 cache by
default with those scales (not measured again), and with a 16-bit or fp32 cache computes what
its source does."""

from __future__ import annotations

import math

import torch

from kiln import LLM, SamplingParams
from kiln.builder.build import BuildOptions, build_engine
from kiln.config import EngineConfig
from kiln.runtime.model_loader import load_model
from tests.conftest import generated_logprob_gaps
from tests.models.test_kv_scales import _prefill
from tests.tiny_tokenizer import build_tiny_chat_model

ARGS = dict(kv_cache_memory_gb=0.05, max_num_seqs=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)
PROMPTS = [[1, 5, 9, 33, 7], [1, 20, 3, 17]]


def test_an_int8_kv_build_stores_and_folds_per_head_scales(tmp_path):
    source = build_tiny_chat_model(str(tmp_path / "chat"))  # calibration needs a tokenizer
    out = str(tmp_path / "int8kv")
    options = BuildOptions(
        dtype="float32", kv_cache_dtype="int8", accuracy_check=False, max_model_len=128
    )
    manifest = build_engine(source, out, options, None)
    scales = manifest.kv_head_scales
    assert scales is not None and len(scales) == 2  # layers
    for k, v in scales:
        assert len(k) == len(v) == 2  # KV heads
        assert all(s > 0 and math.log2(s) == round(math.log2(s)) for s in k + v)

    llm = LLM(out, **ARGS)  # the engine's cache dtype by default
    assert llm.engine.executor.facts.kv_cache_dtype == "int8"
    model = llm.engine.executor.runner.model
    assert [list(a.self_attn.folded_kv_head_scales) for a in model.layers] == scales
    want = LLM(source, **ARGS).generate(PROMPTS, GREEDY)
    gaps = generated_logprob_gaps(llm.generate(PROMPTS, GREEDY), want)
    assert float(gaps.max()) < 0.3  # int8 rounding on a tiny random model's flat logits

    # With an fp32 cache the engine is its source: its cache holds each head over its scale.
    cpu = torch.device("cpu")
    engine = load_model(EngineConfig(model=out), cpu, torch.float32).model
    plain = load_model(EngineConfig(model=source), cpu, torch.float32).model
    hidden, caches = _prefill(engine)
    want_hidden, want_caches = _prefill(plain)
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    for (kc, vc), (want_k, want_v), (ks, vs) in zip(caches, want_caches, scales):
        for h in range(2):
            torch.testing.assert_close(kc[:, :, h], want_k[:, :, h] / ks[h], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(vc[:, :, h], want_v[:, :, h] / vs[h], rtol=1e-5, atol=1e-6)
