"""Packs one step's scheduled tokens into flat tensors (no padding) for the model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kiln.attention.backend import AttentionMetadata
from kiln.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """The runner's copy of a request: enough to build inputs and sample, nothing more."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int

    def __post_init__(self) -> None:
        self.token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PackedBatch:
    req_ids: list[str]  # batch order: decodes (one token) first, then prefill chunks
    num_scheduled: list[int]  # tokens of each request this step, batch order
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    query_start_loc_cpu: list[int]
    sampling_rows: list[int]  # batch indices of requests that sample this step
    logits_indices: torch.Tensor  # [len(sampling_rows)]: each one's last token in the pack


def build_packed_batch(
    states: list[CachedRequestState],  # in batch order
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
) -> PackedBatch:
    num_seqs = len(states)
    query_lens = np.asarray(num_scheduled, dtype=np.int64)
    query_start_loc = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    start_positions = np.asarray([s.num_computed_tokens for s in states], dtype=np.int64)
    seq_lens = start_positions + query_lens

    # Token i of sequence r sits at position start_positions[r] + i.
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = (
        np.arange(num_tokens) - query_start_loc[seq_of_token] + start_positions[seq_of_token]
    )
    input_ids = np.empty(num_tokens, dtype=np.int64)
    for r, state in enumerate(states):
        a, b = int(start_positions[r]), int(seq_lens[r])
        input_ids[query_start_loc[r] : query_start_loc[r + 1]] = state.token_ids[a:b]

    max_blocks = max(len(s.block_ids) for s in states)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for r, state in enumerate(states):
        block_tables[r, : len(state.block_ids)] = state.block_ids
    slot_mapping = (
        block_tables[seq_of_token, positions // block_size].astype(np.int64) * block_size
        + positions % block_size
    )

    sampling_rows = [r for r, s in enumerate(states) if seq_lens[r] == s.num_tokens]
    logits_indices = query_start_loc[1:][sampling_rows] - 1
    num_decodes = 0
    while num_decodes < num_seqs and query_lens[num_decodes] == 1:
        num_decodes += 1

    def to_dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        return torch.from_numpy(a).to(device=device, dtype=dtype, non_blocking=True)

    metadata = AttentionMetadata(
        slot_mapping=to_dev(slot_mapping, torch.int64),
        query_start_loc=to_dev(query_start_loc, torch.int32),
        seq_lens=to_dev(seq_lens, torch.int32),
        block_tables=to_dev(block_tables, torch.int32),
        num_decodes=num_decodes,
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
    )
    return PackedBatch(
        req_ids=[s.req_id for s in states],
        num_scheduled=list(num_scheduled),
        input_ids=to_dev(input_ids, torch.int64),
        positions=to_dev(positions, torch.int64),
        metadata=metadata,
        query_start_loc_cpu=query_start_loc.tolist(),
        sampling_rows=sampling_rows,
        logits_indices=to_dev(np.asarray(logits_indices, dtype=np.int64), torch.int64),
    )
