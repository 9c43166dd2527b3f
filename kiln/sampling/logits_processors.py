"""Logits processors: ordered steps between the penalties and the choice of token.

Each says whether it can change a greedy row's argmax. The sampler's greedy fast path (argmax of
the raw logits, no fp32 copy) runs only when every active processor preserves it; a processor
that may change it (min_tokens, a grammar's token bitmask; logit bias later) sends the batch down
the full path. Processors never write into the logits they are given.
"""

from __future__ import annotations

import functools
import sys
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


class TokenBitmaskProcessor(LogitsProcessor):
    """Tokens outside a row's allowed set (a packed bitmask, e.g. a grammar's next tokens, built
    by kiln/structured_output) are set to -inf. Rows without a constraint are all ones."""

    preserves_argmax = False

    def is_active(self, metadata: SamplingMetadata) -> bool:
        return metadata.token_bitmask is not None

    def apply(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        assert metadata.token_bitmask is not None  # applied only where is_active
        forbidden = forbidden_by_bitmask(metadata.token_bitmask, logits.shape[-1])
        return logits.masked_fill(forbidden, float("-inf"))


def default_logits_processors() -> tuple[LogitsProcessor, ...]:
    return (MinTokensProcessor(), TokenBitmaskProcessor())


def forbidden_by_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 -> [B, V] bool, True where a token is not allowed: the negation of
    unpack_bitmask (its reference) in two kernels. On a little-endian machine byte 4w + k of the
    mask holds tokens 32w + 8k .. 32w + 8k + 7, so token t is bit t % 8 of byte t // 8, and one
    lookup in a [256, 8] table turns each byte into its 8 flags (1 byte of traffic a token,
    where the shifts write 4 bytes a token twice)."""
    if sys.byteorder != "little":
        return ~unpack_bitmask(bitmask, vocab_size)
    num_rows = bitmask.shape[0]
    table = _forbidden_bits_table(bitmask.device)
    mask_bytes = bitmask.contiguous().view(torch.uint8).view(-1)
    forbidden = table.index_select(0, mask_bytes.int()).view(num_rows, -1)
    if forbidden.shape[1] >= vocab_size:
        return forbidden[:, :vocab_size]
    pad = forbidden.new_ones(num_rows, vocab_size - forbidden.shape[1])
    return torch.cat([forbidden, pad], dim=1)


@functools.cache
def _forbidden_bits_table(device: torch.device) -> torch.Tensor:  # [256, 8] bool
    """Row b: which of byte b's 8 bits are clear, lowest bit first."""
    bits = torch.arange(8)
    return ((torch.arange(256)[:, None] >> bits) & 1).eq(0).to(device)


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, ceil(V/32)] int32 (bit j of word w allows token 32w + j; xgrammar's layout) ->
    [B, V] bool. Ids past the mask's width (a padded vocabulary) are not allowed."""
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift: the sign bit is bit 31
    allowed = bits.view(bitmask.shape[0], -1).bool()
    if allowed.shape[1] >= vocab_size:
        return allowed[:, :vocab_size]
    pad = allowed.new_zeros(allowed.shape[0], vocab_size - allowed.shape[1])
    return torch.cat([allowed, pad], dim=1)


def mask_tokens(logits: torch.Tensor, token_ids: list[list[int]]) -> torch.Tensor:
    """Set logits[i, id] = -inf for every id in token_ids[i]; returns a new tensor."""
    rows = [row for row, ids in enumerate(token_ids) for _ in ids]
    cols = [token_id for ids in token_ids for token_id in ids]
    device = logits.device
    index = (to_device(rows, torch.long, device), to_device(cols, torch.long, device))
    return logits.index_put(index, logits.new_full((), float("-inf")))  # a fill, not a host copy
