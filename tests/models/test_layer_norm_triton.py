"""The LayerNorm families (StableLM 2, Cohere, Starcoder2) through the Triton kernels and
attention backend (TRITON_INTERPRET=1 without a GPU), end to end: every norm runs as the norm
kernels' LayerNorm flavour (the residual add fused in; quantizing where the projection takes
float8), the per-head q/k LayerNorm inside the q/k-norm + rotary kernel, and no reference
LayerNorm on that path. Greedy tokens equal Hugging Face's in fp32 (prompts in chunks beside
decodes); FP8 W8A8, W8A8 INT8 and the float8 KV cache take the quantizing norm entries, as
Llama's do."""

from __future__ import annotations

import inspect
import os
from collections import Counter

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln import LLM, SamplingParams
from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import (
    hf_generated,
    perturb_norms_and_biases,
    save_tiny_hf,
    tokens,
    triton_chunked_llm,
)
from tests.models.test_qk_layernorm import perturb

NEW_TOKENS = 8
PROMPTS = [[1, *range(40, 62)], [1, 5, 9, 30], [1, *range(200, 215)]]
# (model_type, architecture, overrides, per-head q/k LayerNorm, parallel blocks)
VARIANTS = {
    # StableLM 2 12B's blocks: per-head q/k LayerNorm, a quarter of each head rotated,
    # attention and MLP in parallel off one biased LayerNorm, q/k/v biases.
    "stablelm_12b": ("stablelm", "StableLmForCausalLM",
                     dict(qk_layernorm=True, partial_rotary_factor=0.25, use_qkv_bias=True,
                          use_parallel_residual=True), True, True),
    # StableLM 2 1.6B's: two biased LayerNorms a layer, partial rotary.
    "stablelm": ("stablelm", "StableLmForCausalLM",
                 dict(partial_rotary_factor=0.25, use_qkv_bias=True), False, False),
    # Command R+: LayerNorms without bias, parallel blocks, per-head q/k LayerNorm.
    "cohere": ("cohere", "CohereForCausalLM",
               dict(use_qk_norm=True, logit_scale=0.25, attention_bias=True), True, True),
    "starcoder2": ("starcoder2", "Starcoder2ForCausalLM", dict(sliding_window=7), False, False),
}  # fmt: skip
NORM_ENTRIES = ("rms_norm", "fused_add_rms_norm", "add_rms_norm_quant_fp8",
                "add_rms_norm_quant_int8")  # fmt: skip


def _save(variant: str, path: str) -> torch.nn.Module:
    model_type, architecture, overrides, qk_norm, _ = VARIANTS[variant]
    return save_tiny_hf(path, model_type, architecture, layer_norm_eps=1e-5,
                        perturb=perturb if qk_norm else perturb_norms_and_biases,
                        **overrides)  # fmt: skip


def _record(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """Counts of the Triton norm entries called (by name and flavour); the reference
    LayerNorms raise if anything on the Triton path calls them."""
    seen: Counter = Counter()
    names = (*NORM_ENTRIES, "qk_norm_rotary_write_kv", "add_rms_norm_linear",
             "add_rms_norm_qkv_rotary_write_kv", "add_rms_norm_linear_silu_mul",
             "add_rms_norm_linear_silu_mul_fp8")  # fmt: skip
    for name in names:
        fn = getattr(triton_ops, name)

        def counted(*args, _fn=fn, _name=name, **kwargs):
            bound = inspect.signature(_fn).bind(*args, **kwargs).arguments
            seen[(_name, bool(bound.get("layer_norm", False)))] += 1
            return _fn(*args, **kwargs)

        monkeypatch.setattr(triton_ops, name, counted)

    def refused(*args, **kwargs):
        raise AssertionError("a reference LayerNorm on the Triton path")

    for name in ("layer_norm", "head_layer_norm", "_layer_norm"):
        monkeypatch.setattr(reference, name, refused)
    return seen


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_triton_layer_norm_families_equal_hf(variant: str, tmp_path, monkeypatch) -> None:
    path = str(tmp_path / "src")
    want = hf_generated(_save(variant, path), PROMPTS, NEW_TOKENS)
    llm = triton_chunked_llm(path, dtype="float32")
    seen = _record(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params)) == want
    _, _, _, qk_norm, parallel = VARIANTS[variant]
    flavoured = {name for (name, ln), n in seen.items() if ln and n}
    plain = {name for (name, ln), n in seen.items() if not ln and n}
    # The norms: LayerNorm flavour only; the one-row RMSNorm + projection kernels never.
    assert flavoured >= {"fused_add_rms_norm"}, seen
    assert not plain & {*NORM_ENTRIES, "add_rms_norm_qkv_rotary_write_kv"}, seen
    assert not {"add_rms_norm_linear", "add_rms_norm_linear_silu_mul"} & plain, seen
    assert ("qk_norm_rotary_write_kv" in flavoured) == qk_norm, seen
    # A forward: the first layer's first norm has no residual to add (rms_norm), every other
    # norm fuses its add; parallel layers one norm a layer, others two; then the final norm.
    layers = llm.engine.executor.runner.model.config.num_hidden_layers
    forwards = seen[("rms_norm", True)]
    assert forwards > 0
    assert seen[("fused_add_rms_norm", True)] == forwards * (layers if parallel else 2 * layers)


QUANTIZED = {
    "fp8-dynamic": ("add_rms_norm_quant_fp8", torch.float8_e4m3fn),
    "int8-w8a8": ("add_rms_norm_quant_int8", torch.int8),
}


@pytest.mark.parametrize(
    ("variant", "quantization"),
    # Each family once: StableLM 2 12B's parallel blocks and q/k LayerNorms, Starcoder2's
    # biased norms, Cohere's parallel blocks under INT8.
    [("stablelm_12b", "fp8-dynamic"), ("starcoder2", "fp8-dynamic"), ("cohere", "int8-w8a8")],
)  # fmt: skip
def test_quantized_projections_take_the_quantizing_layer_norms(
    variant: str, quantization: str, tmp_path, monkeypatch
) -> None:
    """FP8 W8A8 (dynamic scales) or W8A8 INT8, and a float8 KV cache, through the Triton path:
    every projection after a norm reads the quantizing LayerNorm's float8 (int8) rows (no
    model-dtype norm but the final one), and the tokens' logprobs stay within float8's noise
    of the reference ops' run."""
    entry, weight_dtype = QUANTIZED[quantization]
    path = str(tmp_path / "src")
    _save(variant, path)
    llm = triton_chunked_llm(path, dtype="float32", quantization=quantization,
                             kv_cache_dtype="fp8")  # fmt: skip
    layer = llm.engine.executor.runner.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == weight_dtype
    assert llm.engine.executor.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    seen = _record(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    got = llm.generate(PROMPTS, params)
    monkeypatch.undo()
    cpu = LLM(path, block_size=4, max_num_batched_tokens=12, max_num_seqs=4,
              kv_cache_memory_gb=0.01, device="cpu", enforce_eager=True, dtype="float32",
              quantization=quantization, kv_cache_dtype="fp8")  # fmt: skip
    assert cpu.engine.executor.runner.backend.name == "torch"
    # The bound the Llama float8 paths are held to (family_checks.check_fp8_close).
    gaps = generated_logprob_gaps(got, cpu.generate(PROMPTS, params))
    assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps
    # The model-dtype LayerNorm only as the final norm: one a forward, beside the quantizing
    # entries (two a layer: parallel MLPs re-read the stream).
    forwards = seen[("fused_add_rms_norm", True)]
    layers = llm.engine.executor.runner.model.config.num_hidden_layers
    assert forwards > 0 and seen[(entry, True)] == 2 * layers * forwards, seen
    assert not seen[("rms_norm", True)], seen
