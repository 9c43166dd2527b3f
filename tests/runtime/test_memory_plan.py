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
