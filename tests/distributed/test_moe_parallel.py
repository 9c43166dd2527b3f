"""Mixture-of-experts models over 2 processes on the CPU (gloo), against Hugging Face in fp32:
tensor-parallel experts (each rank a slice of every expert; vLLM's default under
--tensor-parallel-size) and expert parallelism (--enable-expert-parallel: each rank whole
experts), for Mixtral, Qwen3-MoE (a dense layer among the sparse ones), Qwen2-MoE (a shared
expert), GLM-4.5 (sigmoid routing over groups, an ungated shared expert, a dense layer
first) and DeepSeek-V3 (GLM's experts under multi-head latent attention: the heads split, the
low-rank projections and the cached latent every rank's; with q_b_proj, and with q_proj cut
beside the whole kv_a_proj_with_mqa in one fused projection). Greedy tokens equal HF's for the
prompts batched, with 16-token steps (the 51-token prompt prefilled in 4 chunks beside the
others' decodes), and for that prompt alone again (its blocks then from the prefix cache). One
engine per family and mode: most of the time is the worker process starting."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from tests.models.family_checks import perturb_norms_and_biases, save_tiny_hf
from tests.models.test_deepseek import DEEPSEEK_V3, DEEPSEEK_V3_NO_Q_LORA
from tests.models.test_glm4_moe import GLM, perturb_glm
from tests.models.test_moe import FAMILIES
from tests.models.test_qwen3 import PROMPTS

NEW_TOKENS = 8
# GLM-4.5's and DeepSeek-V3's: a dense first layer, then sigmoid-routed experts.
_DEEPSEEK_STYLE = {
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM", GLM),
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_V3),
    "deepseek_v3_q_proj": ("deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK_V3_NO_Q_LORA),
}
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
ENGINE = dict(dtype="float32", device="cpu", num_threads=1, distributed_timeout_s=60,
              block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=8,
              max_num_batched_tokens=16)  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, list[list[int]]]]:
    """Each family's tiny checkpoint (tests/models/test_moe.py's) and HF's greedy tokens."""
    out = {}
    families = {**FAMILIES, **_DEEPSEEK_STYLE}
    for family, (model_type, architecture, overrides) in families.items():
        path = str(tmp_path_factory.mktemp(family))
        perturb = perturb_glm if family in _DEEPSEEK_STYLE else perturb_norms_and_biases
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
@pytest.mark.parametrize("family", [*FAMILIES, *_DEEPSEEK_STYLE])
def test_two_ranks_equal_hf(checkpoints, family, expert_parallel) -> None:
    path, want = checkpoints[family]
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        model = llm.engine.executor.runner.model
        sparse = 1 if family in _DEEPSEEK_STYLE else 0
        experts = model.layers[sparse].mlp.experts
        # 4 experts (GLM's 8) of width 32: half of them whole (EP), or every one's 16 columns.
        count = 8 if family in ("glm4_moe", "deepseek_v3") else 4
        if family.startswith("deepseek"):  # 2 of the 4 heads; the latent (and its cache) whole
            attn = model.layers[0].self_attn
            assert attn.num_heads == 2 and attn.kv_b_proj.weight.shape == (2 * 32, 32)
            q_rows = 32 if family == "deepseek_v3" else 2 * 24  # q_a_proj's, or 2 heads' q_proj
            assert attn.qkv_a_proj.weight.shape == (q_rows + 40, 64)
            assert llm.engine.executor.runner.kv_caches[0][0].shape[2:] == (1, 40)
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
