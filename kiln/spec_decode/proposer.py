"""The proposer interface: after a step's tokens are known, drafts for the next step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from kiln.sampling_params import SamplingParams

if TYPE_CHECKING:
    import numpy as np
    import torch


class DraftRequest(Protocol):
    """What a proposer reads of a request (the runner's per-request state has these)."""

    req_id: str
    token_ids: list[int]  # prompt + every generated token known on the host
    sampling_params: SamplingParams


class Proposer(ABC):
    """Proposes up to `num_speculative_tokens` drafts per request. Proposals may be shorter or
    empty (nothing found); the scheduler may verify fewer (policy, budget, max_tokens)."""

    num_speculative_tokens: int
    decides_acceptance: bool = False
    """Benchmarks only (the oracle's accept_by_draw): the proposer, not the target, says which
    drafts a verification accepts (`accepted_rows`). False for every real proposer."""

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Drafts for each request's next tokens, by request id (absent: none)."""

    uses_target_hidden_states: bool = False
    """EAGLE-3: the runner hands every forward's auxiliary target hidden states to
    `record_target_hidden_states` (and the target computes them only then)."""

    def record_target_hidden_states(
        self,
        requests: Sequence,  # the step's CachedRequestStates, in row order
        num_scheduled: Sequence[int],
        query_start_loc: np.ndarray,  # [len(requests) + 1]: each request's first row
        aux_hidden_states: torch.Tensor,  # [>= rows, width]: the target's buffer
    ) -> None:
        """Only where `uses_target_hidden_states`: called after each target forward, before
        the requests' computed-token counts move past the step's positions."""
        raise NotImplementedError(f"{type(self).__name__} reads no target hidden states")

    def accepted_rows(self, req_ids: Sequence[str], num_drafts: Sequence[int]) -> list[bool]:
        """Only where `decides_acceptance`: per verification row, whether its draft counts as
        accepted (each request's num_drafts rows, then its bonus row)."""
        raise NotImplementedError(f"{type(self).__name__} does not decide acceptance")

    def remove(self, req_id: str) -> None:
        """The request finished or was preempted: drop any state held for it."""
        return None
