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

from kiln import SamplingParams
from tests.models.family_checks import (
    hf_generated,
    perturb_norms_and_biases,
    save_tiny_hf,
    tokens,
    triton_chunked_llm,
)
from tests.models.test_gemma2_gemma3 import VARIANTS

NEW_TOKENS = 10
PROMPTS = [[1, *range(40, 62)], [1, 5, 9, 30], [1, *range(200, 215)]]


def test_triton_groups_equal_hf(tmp_path) -> None:
    model_type, hf_class, overrides = VARIANTS["gemma3"]
    path = str(tmp_path / "src")
    model = save_tiny_hf(path, model_type, hf_class, perturb=perturb_norms_and_biases, **overrides)
    want = hf_generated(model, PROMPTS, NEW_TOKENS)
    llm = triton_chunked_llm(path)
    runner = llm.engine.executor.runner
    assert runner.num_kv_groups == 3 and runner.backend.name == "triton"
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert tokens(llm.generate(PROMPTS, params)) == want
