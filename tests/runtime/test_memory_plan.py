"""The memory plan's summary line: what it says a GPU's budget would hold beyond the cache."""

from __future__ import annotations

import torch
from torch import nn

from kiln.runtime.memory_plan import GiB, MemoryPlan, resident_bytes


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
    assert "sequences at once 786 x 2000;" in capped
    assert "the budget holds 966 x 2000" in capped
    full = _plan(96, 96 * 1024).describe(2000)
    assert "786 x 2000" in full and "budget holds" not in full


def test_a_window_on_every_layer_counts_sequences_at_their_window() -> None:
    from kiln.config import EngineConfig
    from kiln.runtime.memory_plan import group_plans
    from tests.conftest import tiny_model_config

    config = EngineConfig(max_num_batched_tokens=512, block_size=16)
    mistral = tiny_model_config("mistral", sliding_window=4096)
    groups = group_plans(mistral, config, 32768)
    (held,) = [g.tokens_held for g in groups]
    # Between steps: the window's blocks, one where it starts mid-block, one for the next token.
    assert held == 4095 + 2 * 16 and groups[0].step_tokens == 512
    assert [g.tokens_held for g in group_plans(tiny_model_config("mistral"), config, 32768)] == [
        None
    ]
    plan = MemoryPlan(8 * GiB, 1 << 20, 96 * GiB, 96 * 1024, 16, groups=groups)
    assert plan.max_tokens_held == held
    # 32k-token sequences hold 4127 tokens (258 blocks) each, beside one step's 32 blocks:
    # (98304 - 32) // 258 = 380 at once, not 48.
    # 4k-token sequences hold all of theirs: 256 blocks, (98304 - 32) // 256 = 383.
    assert "sequences at once 383 x 4096, 380 x 32768" in plan.describe(32768)
    # One group: no other kind of layer to count against.
    assert "every layer" not in plan.describe(32768)
    assert plan.longest_fitting(32768) == 32768


def test_hybrid_groups_count_windowed_layers_at_their_window() -> None:
    """Gemma-3-12B's shape: 8 full layers and 40 of window 1024, in groups of 8 sharing a pool
    block (kiln.models.kv_groups): a long sequence holds its whole context in one group and a
    window in five."""
    from kiln.config import EngineConfig
    from kiln.models.config import PRESETS, ModelConfig
    from kiln.runtime.memory_plan import group_plans

    cfg = ModelConfig.from_hf_dict(PRESETS["gemma-3-12b"])
    config = EngineConfig(max_num_batched_tokens=2048, block_size=16)
    groups = group_plans(cfg, config, 131072)
    assert [(g.window, g.num_layers, g.tokens_held) for g in groups] == [
        (None, 8, None),
        *[(1024, 8, 1023 + 32)] * 5,
    ]
    # A block of 8 layers' K and V (8 KV heads x 256 dims, float8): 2 x 8 x 16 x 8 x 256 bytes.
    per_block = 2 * 8 * 16 * 8 * 256
    plan = MemoryPlan(
        24 * GiB, per_block, 80 * GiB, 80 * GiB // per_block, 16, groups=groups,
        layer_token_bytes=2 * 8 * 256,
    )  # fmt: skip
    # 128k: 8192 blocks in the full group, 66 in each windowed one; 5 x 128 blocks for a step.
    assert plan.blocks_per_seq(131072) == 8192 + 5 * 66
    assert plan.max_concurrent_seqs(131072) == (plan.num_blocks - 640) // 8522 == 19
    # Every layer keeping its whole context: 48 layers x 128k tokens each = 3 sequences.
    every_layer = plan.num_blocks * per_block // (131072 * 48 * 2 * 8 * 256)
    assert every_layer == 3
    assert plan.sequences_keeping_every_layer(131072) == every_layer
    text = plan.describe(131072)
    # 4k: 163200 // (256 + 330) = 278 against 80 GiB // (4096 x 48 x 4 KiB) = 106; 32k:
    # 163200 // (2048 + 330) = 68 against 13.
    assert "sequences at once 278 x 4096, 68 x 32768, 19 x 131072" in text
    assert "every layer's whole context would hold 106 x 4096, 13 x 32768, 3 x 131072" in text
    # kiln bench's record: the same numbers at the report lengths up to its longest request.
    assert plan.as_dict(32768)["sequences_that_fit"] == {
        "4096": {"planned": 278, "every_layer": 106},
        "32768": {"planned": 68, "every_layer": 13},
    }
    assert "sequences_that_fit" not in plan.as_dict()
    # A decode reads 8 layers' whole context and 40 layers' windows.
    assert plan.kv_bytes_read(131072) == 2 * 8 * 256 * (8 * 131072 + 40 * 1024)


def test_resident_bytes_count_weights_relaid_into_buffers() -> None:
    """INT4's codes re-laid for the sm_90 kernel live in a buffer, the parameter left empty:
    the plan's weight bytes still count them, and no other buffer (rotary tables)."""
    layer = nn.Linear(8, 4, bias=False)
    layer.weight = nn.Parameter(torch.empty(0))
    layer.register_buffer("weight_mma", torch.zeros(16, 4, dtype=torch.int32), persistent=False)
    layer.register_buffer("cos_sin", torch.zeros(100))
    model = nn.Sequential(layer)
    assert resident_bytes(model) == 16 * 4 * 4
