"""A request's greedy output must not change because it was batched, chunked, preempted or
served from the prefix cache (SmolLM2, fp32, CPU)."""

from __future__ import annotations

import random

import pytest

from kiln import LLM, SamplingParams

NEW_TOKENS = 12


def make_prompts(n: int = 32, seed: int = 0) -> list[str]:
    words = [
        "the",
        "river",
        "mountain",
        "quiet",
        "city",
        "library",
        "engine",
        "winter",
        "garden",
        "music",
        "history",
        "bright",
        "science",
        "ocean",
        "friend",
        "light",
        "story",
        "paper",
        "window",
        "morning",
        "forest",
        "machine",
        "number",
    ]
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        length = rng.choice([3, 8, 20, 45, 90])  # mixed lengths, some spanning many blocks
        prompts.append(f"Story {i}: " + " ".join(rng.choice(words) for _ in range(length)))
    return prompts


PROMPTS = make_prompts()
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(smollm2_llm) -> list[list[int]]:
    """Each prompt on its own, one at a time."""
    return [smollm2_llm.generate(p, PARAMS)[0].outputs[0].token_ids for p in PROMPTS]


def tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_batch_of_32_mixed_lengths(smollm2_llm, alone):
    assert tokens(smollm2_llm.generate(PROMPTS, PARAMS)) == alone


def test_tiny_chunked_prefill_budget(smollm2_path, alone):
    llm = LLM(smollm2_path, max_num_batched_tokens=7, max_num_seqs=8, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, PARAMS)) == alone


def test_preemption_under_tiny_kv_pool(smollm2_path, alone):
    # 12 blocks of 16 tokens: the longest request (~110 tokens) fits alone, 32 at once do not.
    llm = LLM(smollm2_path, num_kv_blocks=12, block_size=16, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, PARAMS)) == alone
    assert llm.engine.scheduler.num_preemptions_total > 0


def test_prefix_cache_hits_do_not_change_outputs(smollm2_path, alone):
    llm = LLM(smollm2_path, block_size=4)
    first = llm.generate(PROMPTS, PARAMS)
    second = llm.generate(PROMPTS, PARAMS)  # every prompt's prefix is now cached
    assert tokens(first) == alone and tokens(second) == alone
    assert all(o.num_cached_tokens > 0 for o in second)
    assert llm.engine.kv_cache.stats.hits > 0
