"""A Qwen FP8 release (128x128 block scales on every projection and expert;
tests/models/test_moe_fp8_block.py's tiny Qwen3-MoE) over 2 processes on the CPU (gloo):
tensor-parallel experts (each rank one 128-block of every expert's width; the attention and
dense MLP cut on whole input blocks) and expert parallelism (whole experts), against
transformers on the dequantized weights with inputs rounded as kiln rounds them (expert
parallelism: the experts' at every step, its ranks running the grouped GEMM at every size).
Batched, then one prompt again from the prefix cache."""

from __future__ import annotations

import pytest

from kiln import LLM
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.test_moe_fp8_block import (
    PROMPTS,
    QWEN3_MOE,
    check_against,
    oracle,
    write_fp8_release,
)

ENGINE = dict(dtype="float32", device="cpu", num_threads=1, distributed_timeout_s=60,
              block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=4)  # fmt: skip


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("qwen3_moe_fp8_gloo")
    save_tiny_hf(str(root / "src"), "qwen3_moe", "Qwen3MoeForCausalLM",
                 perturb=perturb_norms_and_biases, **QWEN3_MOE)  # fmt: skip
    write_fp8_release(str(root / "src"), str(root / "fp8"))
    return str(root / "fp8")


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_equal_hf_dequantized(release, expert_parallel) -> None:
    model = oracle(release, always_rounded=expert_parallel)
    llm = LLM(release, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        experts = llm.engine.executor.runner.model.layers[0].mlp.experts
        assert experts.w2_weight_scale.shape == ((2, 128, 2) if expert_parallel else (4, 128, 1))
        check_against(model, llm, PROMPTS)
        hits = llm.engine.kv_cache.stats.hits
        check_against(model, llm, PROMPTS[2:])
        assert llm.engine.kv_cache.stats.hits > hits
    finally:
        llm.shutdown()
