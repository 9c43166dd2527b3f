"""A hybrid model's KV cache groups under tensor and pipeline parallelism on the CPU (gloo):
tiny Gemma 3 (two local layers of window 5, one global, in three groups of one layer), blocks
of 4, prompts past the window; greedy tokens equal one process's at TP=2 and PP=2 (each stage
makes only the KV tensors its layers use)."""

from __future__ import annotations

import pytest

from kiln import LLM, SamplingParams
from tests.distributed.test_parallel import COMMON, _assert_same
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.test_gemma2_gemma3 import VARIANTS

PROMPTS = [[1, *range(40, 70)], [1, 5, 9, 13, 40], [1, *range(100, 121)]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=2, ignore_eos=True)
ENGINE = dict(block_size=4, max_num_batched_tokens=16, **COMMON)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    model_type, hf_class, overrides = VARIANTS["gemma3"]
    path = str(tmp_path_factory.mktemp("gemma3") / "src")
    save_tiny_hf(
        path, model_type, hf_class, perturb=perturb_norms_and_biases,
        **{**overrides, "sliding_window": 5},
    )  # fmt: skip
    return path, LLM(path, **ENGINE).generate(PROMPTS, GREEDY)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_hybrid_groups_in_parallel_equal_one_process(gemma3, tp, pp) -> None:
    path, want = gemma3
    llm = LLM(path, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE)
    try:
        assert len(llm.engine.kv_cache.groups) == 3
        _assert_same(llm.generate(PROMPTS, GREEDY), want)
    finally:
        llm.shutdown()
