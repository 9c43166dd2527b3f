"""The attention metadata of one synthetic prefill step: sequences of given lengths packed one
after another, each in its own fresh cache blocks. The memory plan's profiling step and the
layer-sequential calibration pass both run such a step outside the scheduler."""

from __future__ import annotations

import torch

from kiln.attention.backend import AttentionMetadata


def packed_prefill_metadata(
    lens: list[int], block_size: int, device: torch.device | str
) -> tuple[AttentionMetadata, int]:
    """(metadata, blocks used): sequence r prefills lens[r] tokens from position 0 in blocks
    numbered after the previous sequence's, so the cache needs `blocks used` blocks."""
    blocks = [-(-n // block_size) for n in lens]
    tables = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
    slots, first = [], 0
    for r, (n, b) in enumerate(zip(lens, blocks)):
        tables[r, :b] = torch.arange(first, first + b, dtype=torch.int32)
        slots.append(torch.arange(n) + first * block_size)
        first += b
    starts = torch.zeros(len(lens) + 1, dtype=torch.int32)
    starts[1:] = torch.cumsum(torch.tensor(lens), 0)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        num_decodes=0,
        max_query_len=max(lens),
        max_seq_len=max(lens),
    )
    return metadata, first
