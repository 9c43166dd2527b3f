"""KV cache groups from per-layer windows (kiln.models.kv_groups): one group where every layer
attends alike; a full group and windowed ones of equal layer counts for hybrids, each layer's
slot shared by one layer of every group."""

from __future__ import annotations

from kiln.models.config import PRESETS, ModelConfig
from kiln.models.kv_groups import kv_cache_layout


def test_one_kind_is_one_group() -> None:
    llama = ModelConfig.from_hf_dict(PRESETS["llama-3.1-8b"]).kv_cache_layout
    assert not llama.is_hybrid and llama.windows == (None,) and llama.num_slots == 32
    mistral = ModelConfig.from_hf_dict(PRESETS["mistral-7b"]).kv_cache_layout
    assert not mistral.is_hybrid and mistral.windows == (4096,)
    assert mistral.groups[0].layers == tuple(range(32))


def test_gemma3_12b_groups_of_eight() -> None:
    layout = ModelConfig.from_hf_dict(PRESETS["gemma-3-12b"]).kv_cache_layout
    assert layout.num_slots == 8 and layout.windows == (None, *[1024] * 5)
    assert layout.groups[0].layers == tuple(range(5, 48, 6))  # every sixth layer is global
    placement = layout.placement()
    assert sorted(placement) == list(range(48))
    # Each slot is shared by exactly one layer of each of the six groups.
    for slot in range(8):
        assert sorted(g for g, s in placement.values() if s == slot) == list(range(6))


def test_gemma2_alternation_and_uneven_counts() -> None:
    gemma2 = ModelConfig.from_hf_dict(PRESETS["gemma-2-9b"]).kv_cache_layout
    assert gemma2.windows == (None, 4096) and gemma2.num_slots == 21
    assert gemma2.groups[1].layers == tuple(range(0, 42, 2))
    # Gemma-3-27B's shape: 10 global, 52 local: groups of 10, the last local one of 2.
    windows = [None if (i + 1) % 6 == 0 else 1024 for i in range(62)]
    assert sum(w is None for w in windows) == 10
    layout = kv_cache_layout(windows)
    assert layout.num_slots == 10 and [len(g.layers) for g in layout.groups] == [10, *[10] * 5, 2]
    # 20 full and 8 windowed layers: groups of 5, not 8 (the full groups, which hold whole
    # contexts, never leave slots unused; the last windowed one leaves 2).
    layout = kv_cache_layout([None] * 20 + [64] * 8)
    assert layout.num_slots == 5 and [g.window for g in layout.groups] == [None] * 4 + [64] * 2
    assert [len(g.layers) for g in layout.groups] == [5, 5, 5, 5, 5, 3]
    # Two windows and full layers: full first, then the longer window.
    layout = kv_cache_layout([8, None, 16, 8, None, 16])
    assert layout.windows == (None, 16, 8) and layout.num_slots == 2
