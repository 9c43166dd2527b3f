"""A proposer's own paged KV pool: its K/V tensors, the free blocks, each sequence's blocks, and
the attention metadata of a forward over them.

The draft model and the EAGLE-3 head each keep one beside the target's cache (as many blocks,
planned together in kiln.runtime.memory_plan). A sequence's blocks hold its slots in order:
slot s lives at block `blocks[s // block_size]`, offset `s % block_size`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.attention.backend import AttentionMetadata
from kiln.kernels.kv_layout import empty_cache
from kiln.models.config import ModelConfig
from kiln.sampling.host_copy import to_device


class DraftKVPool:
    def __init__(
        self,
        config: ModelConfig,  # the drafter's: KV heads and head size
        num_layers: int,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.block_size = block_size
        self.device = device
        shape = (num_blocks, block_size, config.num_key_value_heads, config.head_dim)
        self.kv_caches = [
            (empty_cache(*shape, dtype, device), empty_cache(*shape, dtype, device))
            for _ in range(num_layers)
        ]
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def reserve(self, blocks: list[int], num_slots: int) -> bool:
        """Grow `blocks` to hold `num_slots` slots; False (and no change) if the pool is short."""
        need = -(-num_slots // self.block_size) - len(blocks)
        if need > len(self._free):
            return False
        for _ in range(max(need, 0)):
            blocks.append(self._free.pop())
        return True

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def attention_metadata(
        self,
        blocks: Sequence[list[int]],  # each sequence's blocks
        first_slots: Sequence[int],  # the slot of each sequence's first query token
        query_lens: Sequence[int],
        num_decodes: int,  # the leading sequences of one query token
    ) -> AttentionMetadata:
        """Each sequence's query writes slots first .. first + len - 1 and attends to all slots
        up to its last."""
        bs, dev = self.block_size, self.device
        slots, qsl, seq_lens = [], [0], []
        width = max(len(b) for b in blocks)
        table = []
        for seq_blocks, first, n in zip(blocks, first_slots, query_lens):
            table += [*seq_blocks, *[0] * (width - len(seq_blocks))]
            slots += [seq_blocks[s // bs] * bs + s % bs for s in range(first, first + n)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(first + n)
        # Pinned copies (to_device): the host goes on launching the draft's forward instead of
        # waiting for the stream at every pageable copy.
        return AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev),
            query_start_loc=to_device(qsl, torch.int32, dev),
            seq_lens=to_device(seq_lens, torch.int32, dev),
            block_tables=to_device(table, torch.int32, dev).view(len(blocks), width),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
