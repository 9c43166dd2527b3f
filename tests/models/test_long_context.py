"""A long prompt on the CPU path: a tiny random Llama with Llama 3.1's rotary scaling ("llama3",
131072 positions) takes an 8k-token prompt in 1k-token chunks (past the scaling's original 8192
positions), then decodes, with the greedy tokens of Hugging Face in fp32 (SDPA over the whole
prompt at once); and the same prompt in one chunk gives the same tokens."""

from __future__ import annotations

import torch

from kiln import LLM, SamplingParams
from tests.models.family_checks import save_tiny_hf

PROMPT_LEN = 8300  # past original_max_position_embeddings (8192): the scaled frequencies matter
NEW_TOKENS = 6
ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def test_long_prompt_chunked_equals_hf_and_one_chunk(tmp_path) -> None:
    path = str(tmp_path / "llama3-long")
    model = save_tiny_hf(path, "llama", "LlamaForCausalLM", max_position_embeddings=131072,
                         rope_parameters=ROPE)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, model.config.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
    model.set_attn_implementation("sdpa")  # eager would hold 4 x 8300^2 fp32 scores a layer
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    want = out[0, PROMPT_LEN:].tolist()
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    args = dict(block_size=16, kv_cache_memory_gb=0.05, max_num_seqs=2, device="cpu",
                max_model_len=PROMPT_LEN + 64, enforce_eager=True)  # fmt: skip
    chunked = LLM(path, max_num_batched_tokens=1024, **args)  # 9 chunks
    assert chunked.generate([prompt], greedy)[0].outputs[0].token_ids == want
    whole = LLM(path, max_num_batched_tokens=PROMPT_LEN + 64, **args)
    assert whole.generate([prompt], greedy)[0].outputs[0].token_ids == want
