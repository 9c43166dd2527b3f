"""The memory plan's summary line: what it says a GPU's budget would hold beyond the cache."""

from __future__ import annotations

from kiln.runtime.memory_plan import GiB, MemoryPlan


def _plan(budget_gib: float, num_blocks: int) -> MemoryPlan:
    return MemoryPlan(
        weight_bytes=8 * GiB,
        bytes_per_block=1 << 20,
        kv_budget_bytes=int(budget_gib * GiB),
        num_blocks=num_blocks,
        block_size=16,
        activation_bytes=4 * GiB,
        total_bytes=140 * GiB,
        kv_dtype="float8_e4m3fn",
    )


def test_plan_says_when_the_budget_holds_more_sequences_than_the_cache() -> None:
    # 1000/1000 on an H200: 768 x 2048 tokens of cache, a budget of ~118 GiB.
    capped = _plan(118, 768 * 128).describe(2000)
    assert "786 sequences of 2000 tokens at once" in capped
    assert "the budget holds 966 such sequences" in capped
    full = _plan(96, 96 * 1024).describe(2000)
    assert "786 sequences" in full and "budget holds" not in full


def test_a_window_on_every_layer_counts_sequences_at_their_window() -> None:
    from kiln.config import EngineConfig
    from kiln.runtime.memory_plan import max_tokens_held
    from tests.conftest import tiny_model_config

    config = EngineConfig(max_num_batched_tokens=512, block_size=16)
    mistral = tiny_model_config("mistral", sliding_window=4096)
    held = max_tokens_held(mistral, config, 32768)
    assert held == 4096 + 512 + 2 * 16  # the window, one step and a block each side
    assert max_tokens_held(tiny_model_config("mistral"), config, 32768) is None
    plan = MemoryPlan(8 * GiB, 1 << 20, 96 * GiB, 96 * 1024, 16, max_tokens_held=held)
    # 32k-token sequences hold 4640 tokens (290 blocks) each: 338 at once, not 48.
    assert "338 sequences of 32768 tokens at once" in plan.describe(32768)
