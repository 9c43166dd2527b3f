"""KV cache groups: which layers share a block table, and which KV tensors they write.

A model whose layers all attend alike (Llama: full attention; Mistral: one window) has one
group: every layer reads one block table, and a pool block holds every layer's K and V.

A hybrid model (Gemma 2/3: sliding-window layers and global ones) has one group per attention
kind, or several of equal size: a window's group gives back the blocks behind its window while
the full group keeps the whole history. The groups share one block pool (as vLLM's hybrid
allocator does), so no split between kinds has to be guessed in advance: a pool block holds
the K and V of `num_slots` layers, and KV tensor (slot) j is shared by the j-th layer of every
group; a block id belongs to one group at a time, so the layers sharing a tensor never meet.
Groups therefore hold the same number of layers, `num_slots` (a kind with more layers is cut
into several groups; a group short of it leaves its last slots unused). Pure Python: the KV
manager, the memory plan, the runner and the decoder all read the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None
    """The window of its layers (each query reads the last `window` positions); None: full."""
    layers: tuple[int, ...]
    """Its layers (indices in the whole model), in order: layers[j] writes KV tensor j."""


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    """Full-attention groups first (a draft model or a one-table reader uses group 0), then by
    window, shortest last."""
    num_slots: int
    """KV tensors (each shared by one layer of every group): the layers a pool block holds."""

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def is_hybrid(self) -> bool:
        return len(self.groups) > 1

    def placement(self) -> dict[int, tuple[int, int]]:
        """Each layer's (group, slot)."""
        return {
            layer: (g, slot)
            for g, group in enumerate(self.groups)
            for slot, layer in enumerate(group.layers)
        }


def kv_cache_layout(windows: Sequence[int | None]) -> KVCacheLayout:
    """The groups of a model whose layer i has window `windows[i]` (None: full attention).

    Groups hold `num_slots` layers each: the largest count up to the smallest kind's layer count
    that divides the full-attention layers' count, so full groups (which hold a request's whole
    history) never leave slots unused; a windowed group may (it holds a window's blocks)."""
    by_kind: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_kind.setdefault(window, []).append(layer)
    if len(by_kind) <= 1:
        window = windows[0] if windows else None
        return KVCacheLayout((KVCacheGroup(window, tuple(range(len(windows)))),), len(windows))
    size = min(len(layers) for layers in by_kind.values())
    num_full = len(by_kind.get(None, ()))
    if num_full:
        size = max(d for d in range(1, size + 1) if num_full % d == 0)
    kinds = sorted(by_kind, key=lambda w: (w is not None, -(w or 0)))
    groups = tuple(
        KVCacheGroup(window, tuple(by_kind[window][i : i + size]))
        for window in kinds
        for i in range(0, len(by_kind[window]), size)
    )
    return KVCacheLayout(groups, size)
