"""Beam search's selection on the device: a step's rows' logits in, each group's best
continuations out (the host gets `keep` candidates a search, not W x vocab log-probabilities).

The arithmetic is Hugging Face's `_beam_search` step: log_softmax of the fp32 logits, plus each
row's cumulative beam score (fp32), then the top `keep` over all of a search's rows and tokens.
It runs in two stages, each row's top `keep` first (what one search's top `keep` over W x vocab
is drawn from, so the values are the same), then the top `keep` of those over the group's rows:
W row-wise top-k over the vocabulary cost what the sampler's logprobs did, where one top-k over
a flattened W x vocab would be a single long slice. Pure torch: the same function on the CPU
(the tests' HF oracle) and the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BeamTopK:
    """Each group's best continuations, best first, the groups one after another."""

    scores: torch.Tensor  # [sum of keeps] float32: cumulative log-probabilities
    rows: torch.Tensor  # [sum of keeps] int64: the row (of the group, from 0) each continues
    token_ids: torch.Tensor  # [sum of keeps] int64
    sizes: list[int]  # each group's count (its keep, or fewer if it has fewer candidates)


def beam_top_k(
    logits: torch.Tensor,  # [R, V] the beam rows' logits (any float dtype)
    scores: torch.Tensor,  # [R] float32: each row's cumulative beam score
    groups: list[tuple[int, int]],  # (rows in the group, keep): consecutive rows, in order
) -> BeamTopK:
    """Per group of consecutive rows: its `keep` best (row, token) by accumulated score."""
    # (fp32 from the start: the same values as log_softmax of the upcast logits, one pass less)
    logprobs = logits.log_softmax(dim=-1, dtype=torch.float32).add_(scores[:, None])
    max_keep = min(max(keep for _, keep in groups), logprobs.shape[-1])
    row_scores, row_ids = logprobs.topk(max_keep, dim=-1)  # [R, max_keep], sorted descending
    if len(groups) == 1:  # the common step: one search, all its rows
        return _group_top_k(row_scores, row_ids, groups[0][1])
    parts, start = [], 0
    for num_rows, keep in groups:
        end = start + num_rows
        parts.append(_group_top_k(row_scores[start:end], row_ids[start:end], keep))
        start = end
    return BeamTopK(
        torch.cat([p.scores for p in parts]),
        torch.cat([p.rows for p in parts]),
        torch.cat([p.token_ids for p in parts]),
        [size for p in parts for size in p.sizes],
    )


def _group_top_k(row_scores: torch.Tensor, row_ids: torch.Tensor, keep: int) -> BeamTopK:
    width = row_scores.shape[1]
    keep = min(keep, row_scores.numel())
    scores, flat = row_scores.reshape(-1).topk(keep)
    return BeamTopK(scores, flat // width, row_ids.reshape(-1)[flat], [keep])
