"""Mixture-of-experts models over 2 processes on the CPU (gloo), against Hugging Face in fp32:
tensor-parallel experts (each rank a slice of every expert; vLLM's default under
--tensor-parallel-size) and expert parallelism (--enable-expert-parallel: each rank whole
experts), for Mixtral, Qwen3-MoE (a dense layer among the sparse ones), Qwen2-MoE (a shared
expert) and GLM-4.5 (sigmoid routing over groups, an ungated shared expert, a dense layer
first). Greedy tokens equal HF's for the prompts batched, with 16-token steps (the 51-token
prompt prefilled in 4 chunks beside the others' decodes), and for that prompt alone again (its
blocks then from the prefix cache). One engine per family and mode: most of the time is the
worker process starting."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.test_glm4_moe import GLM, perturb_glm
from tests.models.test_moe import FAMILIES
from tests.models.test_qwen3 import PROMPTS

NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", num_threads=1, distributed_timeout_s=60,
              block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=8,
              max_num_batched_tokens=16)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """Each family's tiny checkpoint (tests/models/test_moe.py's) and HF's greedy tokens."""
    out = {}
    families = {**FAMILIES, "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM", GLM)}
    for family, (model_type, architecture, overrides) in families.items():
        path = str(tmp_path_factory.mktemp(family))
        perturb = perturb_glm if family == "glm4_moe" else perturb_norms_and_biases
        model = save_tiny_hf(path, model_type, architecture, perturb=perturb, **overrides)
        model.generation_config.eos_token_id = None  # ignore_eos
        want = []
        with torch.no_grad():
            for prompt in PROMPTS:
                ids = torch.tensor([prompt])
                seq = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False,
                                     pad_token_id=0)  # fmt: skip
                want.append(seq[0, len(prompt) :].tolist())
        out[family] = (path, want)
    return out


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("family", [*FAMILIES, "glm4_moe"])
def test_two_ranks_equal_hf(checkpoints, family, expert_parallel) -> None:
    path, want = checkpoints[family]
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        sparse = 1 if family == "glm4_moe" else 0
        experts = llm.engine.executor.runner.model.layers[sparse].mlp.experts
        # 4 experts (GLM's 8) of width 32: half of them whole (EP), or every one's 16 columns.
        count = 8 if family == "glm4_moe" else 4
        assert experts.w13_weight.shape == (
            (count // 2, 64, 64) if expert_parallel else (count, 32, 64)
        )
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
        assert got == want
        hits = llm.engine.kv_cache.stats.hits
        assert llm.generate(PROMPTS[2], GREEDY)[0].outputs[0].token_ids == want[2]
        assert llm.engine.kv_cache.stats.hits > hits
    finally:
        llm.shutdown()
