"""The proposer interface: after a step's tokens are known, drafts for the next step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from kiln.sampling_params import SamplingParams


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

    def accepted_rows(self, req_ids: Sequence[str], num_drafts: Sequence[int]) -> list[bool]:
        """Only where `decides_acceptance`: per verification row, whether its draft counts as
        accepted (each request's num_drafts rows, then its bonus row)."""
        raise NotImplementedError(f"{type(self).__name__} does not decide acceptance")

    def remove(self, req_id: str) -> None:
        """The request finished or was preempted: drop any state held for it."""
        return None
