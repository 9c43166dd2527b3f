"""A hybrid model's KV cache groups through the Triton kernels and attention backend
(TRITON_INTERPRET=1 without a GPU): tiny Gemma 3 (two local layers of window 7, one global),
blocks of 4, prompts past the window in chunks beside decodes, each layer reading its group's
block table; greedy tokens equal Hugging Face's in fp32."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln import LLM, SamplingParams
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf, tokens
from tests.models.test_gemma2_gemma3 import VARIANTS

NEW_TOKENS = 10
PROMPTS = [[1, *range(40, 62)], [1, 5, 9, 30], [1, *range(200, 215)]]


def test_triton_groups_equal_hf(tmp_path) -> None:
    model_type, hf_class, overrides = VARIANTS["gemma3"]
    path = str(tmp_path / "src")
    model = save_tiny_hf(path, model_type, hf_class, perturb=perturb_norms_and_biases, **overrides)
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
        device=device, attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner = llm.engine.executor.runner
    assert runner.num_kv_groups == 3 and runner.backend.name == "triton"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params)) == want
