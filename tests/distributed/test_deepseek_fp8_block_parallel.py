"""DeepSeek-V3's FP8 release format (128x128 block scales on every projection and expert;
tests/models/test_moe_fp8_block.py's writer) over 2 processes on the CPU (gloo): the heads
split on whole 128-row blocks (q_b_proj's rows, o_proj's inputs), the low-rank projections
and the latent every rank's, kv_b_proj dequantized before its cut; experts by tensor or
expert parallelism. The same logprobs as one process on the same release (expert
parallelism: within float8's noise), and a prompt again from the prefix cache."""

from __future__ import annotations

import pytest

from kiln import LLM
from tests.conftest import generated_logprob_gaps
from tests.models.family_checks import save_tiny_hf
from tests.models.test_glm4_moe import perturb_glm
from tests.models.test_moe_fp8_block import GREEDY, PROMPTS, write_fp8_release

# hidden 128 (one input block); 4 heads of 32 + 32 rotary dims: 2 heads' q_b_proj rows and
# their 2 x 64 value columns of o_proj are one block per rank; experts 256 wide.
DEEPSEEK_V3 = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128,
                   kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64,
                   first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=256, n_shared_experts=1, n_group=2, topk_group=1,
                   routed_scaling_factor=1.5)  # fmt: skip
ENGINE = dict(dtype="float32", device="cpu", num_threads=1, distributed_timeout_s=60,
              block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=4)  # fmt: skip


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> tuple[str, list]:
    root = tmp_path_factory.mktemp("deepseek_v3_fp8_gloo")
    save_tiny_hf(str(root / "src"), "deepseek_v3", "DeepseekV3ForCausalLM", perturb=perturb_glm,
                 **DEEPSEEK_V3)  # fmt: skip
    write_fp8_release(str(root / "src"), str(root / "fp8"))
    one = LLM(str(root / "fp8"), **ENGINE)
    return str(root / "fp8"), one.generate(PROMPTS, GREEDY)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_two_ranks_stay_close_to_one(release, expert_parallel) -> None:
    path, want = release
    llm = LLM(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel, **ENGINE)
    try:
        attn = llm.engine.executor.runner.model.layers[1].self_attn
        assert attn.q_b_proj.weight.shape == (128, 128) and attn.o_proj.weight.shape == (128, 128)
        got = llm.generate(PROMPTS, GREEDY)
        gaps = generated_logprob_gaps(got, want)
        if expert_parallel:  # its ranks round the experts' inputs at every step size
            assert gaps.mean() < 0.25 and gaps.max() < 1.5, gaps
        else:  # the same roundings, summed in another order (measured: 1.2e-6 at most)
            assert gaps.max() < 1e-3, gaps
        hits = llm.engine.kv_cache.stats.hits
        again = llm.generate(PROMPTS[2:], GREEDY)
        assert llm.engine.kv_cache.stats.hits > hits
        assert again[0].outputs[0].token_ids == got[2].outputs[0].token_ids
    finally:
        llm.shutdown()
