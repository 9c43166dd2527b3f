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
from kiln.models.config import ModelConfig


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
            (
                torch.zeros(shape, dtype=dtype, device=device),
                torch.zeros(shape, dtype=dtype, device=device),
            )
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
        table = torch.zeros(len(blocks), max(len(b) for b in blocks), dtype=torch.int32)
        for row, (seq_blocks, first, n) in enumerate(zip(blocks, first_slots, query_lens)):
            table[row, : len(seq_blocks)] = torch.tensor(seq_blocks, dtype=torch.int32)
            slots += [seq_blocks[s // bs] * bs + s % bs for s in range(first, first + n)]
            qsl.append(qsl[-1] + n)
            seq_lens.append(first + n)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=table.to(dev),
            num_decodes=num_decodes,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )
