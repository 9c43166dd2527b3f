"""Logits processors: ordered steps between the penalties and the choice of token.

Each says whether it can change a greedy row's argmax. The sampler's greedy fast path (argmax of
the raw logits, no fp32 copy) runs only when every active processor preserves it; a processor
that may change it (min_tokens today; grammars and logit bias later) sends the batch down the
full path. Processors never write into the logits they are given.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from kiln.sampling.host_copy import to_device

if TYPE_CHECKING:
    from kiln.sampling.sampler import SamplingMetadata


class LogitsProcessor(ABC):
    preserves_argmax: bool
    """True if no greedy row's choice can change: the fast path may skip it."""

    @abstractmethod
    def is_active(self, metadata: SamplingMetadata) -> bool:
        """Whether any row of this step needs it (inactive processors cost nothing)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """[B, V] float32 in, a new [B, V] tensor out."""


class MinTokensProcessor(LogitsProcessor):
    """EOS and stop tokens are forbidden until a request has min_tokens outputs."""

    preserves_argmax = False

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return any(metadata.min_tokens_mask_ids)

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        return mask_tokens(logits, metadata.min_tokens_mask_ids)


def default_logits_processors() -> tuple[LogitsProcessor, ...]:
    return (MinTokensProcessor(),)


def mask_tokens(logits: torch.Tensor, token_ids: list[list[int]]) -> torch.Tensor:
    """Set logits[i, id] = -inf for every id in token_ids[i]; returns a new tensor."""
    rows = [row for row, ids in enumerate(token_ids) for _ in ids]
    cols = [token_id for ids in token_ids for token_id in ids]
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
    return logits.index_put(index, logits.new_full((), float("-inf")))  # a fill, not a host copy
