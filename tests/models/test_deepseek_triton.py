"""DeepSeek-V3's multi-head latent attention through the Triton kernels and attention backend
(TRITON_INTERPRET=1 without a GPU), end to end: one cache tensor per layer for K and V (the
[k_pe | c_kv] rows, 40 wide), written by the rotary + write kernel, read by the shared prefill
kernel as multi-query attention and by the MLA decode kernel (kiln.kernels.triton.mla_decode);
prompts in chunks beside decodes, blocks of 4. Greedy tokens equal Hugging Face's in fp32; over
a float8 cache, the MLA decode kernel's tokens equal the reference kernels' (the same rows
widened)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln import SamplingParams
from tests.models.family_checks import hf_generated, save_tiny_hf, tokens, triton_chunked_llm
from tests.models.test_deepseek import DEEPSEEK_V3
from tests.models.test_glm4_moe import perturb_glm

NEW_TOKENS = 10
PROMPTS = [[1, *range(40, 62)], [1, 5, 9, 30], [1, *range(200, 215)]]


PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("deepseek_v3") / "src")
    model = save_tiny_hf(path, "deepseek_v3", "DeepseekV3ForCausalLM", perturb=perturb_glm,
                         **DEEPSEEK_V3)  # fmt: skip
    return path, model


def record_calls(monkeypatch, ops, name: str = "mla_decode_attention") -> list[tuple]:
    """(rows, cache dtype) of each call of `ops.<name>` (an attention kernel's entry) from now
    on: for the MLA decode, decode steps and mixed ones."""
    calls = []
    kernel = getattr(ops, name)

    def recorded(query, cache, *args, **kwargs):
        calls.append((query.shape[0], cache.dtype))
        return kernel(query, cache, *args, **kwargs)

    monkeypatch.setattr(ops, name, recorded)
    return calls


def test_triton_mla_equals_hf(v3, monkeypatch) -> None:
    path, model = v3
    want = hf_generated(model, PROMPTS, NEW_TOKENS)
    llm = triton_chunked_llm(path, dtype="float32")
    runner = llm.engine.executor.runner
    assert runner.backend.name == "triton" and runner.kv_caches[0][0] is runner.kv_caches[0][1]
    from kiln.kernels import triton as triton_ops

    decodes = record_calls(monkeypatch, triton_ops)
    assert tokens(llm.generate(PROMPTS, PARAMS)) == want
    assert decodes and max(rows for rows, _ in decodes) == len(PROMPTS)


def test_a_float8_cache_decodes_in_the_mla_kernel(v3, monkeypatch) -> None:
    """kv_cache_dtype="fp8": every decode reads the float8 rows in the MLA decode kernel (none
    in the shared decode kernel), and the tokens equal the same engine's with the kernel's twin
    (the rows widened exactly) in its place: the same cache bytes and prefill kernels. (Other
    engines' float8 tokens differ from these from the second on: the tiny random model's
    greedy choices turn on the float8 roundings of the cache writes and of Q.K in prefill.)"""
    path, _ = v3
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops

    llm = triton_chunked_llm(path, dtype="float32", kv_cache_dtype="fp8")
    assert llm.engine.executor.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
    monkeypatch.setattr(triton_ops, "mla_decode_attention", reference.mla_decode_attention)
    twin_decodes = record_calls(monkeypatch, triton_ops)
    want = tokens(llm.generate(PROMPTS, PARAMS))
    monkeypatch.undo()
    decodes = record_calls(monkeypatch, triton_ops)
    shared = record_calls(monkeypatch, triton_ops, "paged_decode_attention")
    assert tokens(llm.generate(PROMPTS, PARAMS)) == want
    assert twin_decodes and {dtype for _, dtype in decodes} == {torch.float8_e4m3fn}
    assert max(rows for rows, _ in decodes) == len(PROMPTS)
    assert not shared
