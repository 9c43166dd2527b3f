"""DeepSeek-V3's multi-head latent attention through the Triton kernels and attention backend
(TRITON_INTERPRET=1 without a GPU), end to end: one cache tensor per layer for K and V (the
[k_pe | c_kv] rows, 40 wide), written by the rotary + write kernel, read by the prefill and
decode kernels as multi-query attention; prompts in chunks beside decodes, blocks of 4. Greedy
tokens equal Hugging Face's in fp32."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln import LLM, SamplingParams
from tests.models.family_checks import save_tiny_hf, tokens
from tests.models.test_deepseek import DEEPSEEK_V3
from tests.models.test_glm4_moe import perturb_glm

NEW_TOKENS = 10
PROMPTS = [[1, *range(40, 62)], [1, 5, 9, 30], [1, *range(200, 215)]]


def test_triton_mla_equals_hf(tmp_path) -> None:
    path = str(tmp_path / "src")
    model = save_tiny_hf(path, "deepseek_v3", "DeepseekV3ForCausalLM", perturb=perturb_glm,
                         **DEEPSEEK_V3)  # fmt: skip
    model.generation_config.eos_token_id = None
    want = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
            )
            want.append(out[0, len(prompt) :].tolist())
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(
        path, block_size=4, max_num_batched_tokens=12, max_num_seqs=4, kv_cache_memory_gb=0.01,
        device=device, attention_backend="triton", enforce_eager=True, dtype="float32",
    )  # fmt: skip
    runner = llm.engine.executor.runner
    assert runner.backend.name == "triton" and runner.kv_caches[0][0] is runner.kv_caches[0][1]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params)) == want
