"""Benchmark proposer: drafts from a known continuation, each right with a set probability.

Random weights accept nothing a real drafter proposes, so speed as a function of acceptance is
measured with this: given the target's own greedy outputs (from a plain run), propose the next K
reference tokens, each replaced by a wrong one with probability 1 - acceptance_rate. The mean
acceptance length (tokens per verification step) is then 1 + a + a^2 + ... + a^K.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kiln.spec_decode.proposer import DraftRequest, Proposer


def acceptance_rate_for_length(mean_length: float, k: int) -> float:
    """The per-token rate a whose 1 + a + ... + a^k equals mean_length (bisection)."""
    if not 1.0 <= mean_length <= k + 1:
        raise ValueError(f"mean acceptance length must be in [1, {k + 1}], got {mean_length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(k + 1)) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


class OracleProposer(Proposer):
    def __init__(
        self,
        num_speculative_tokens: int,
        references: list[list[int]],
        acceptance_rate: float,
        vocab_size: int,
        seed: int = 0,
        always_propose: bool = False,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.references = [list(r) for r in references]
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        # Without a (matching) reference, propose K wrong tokens anyway: every step then has the
        # verification shape, e.g. to record references with the numerics of verification steps.
        self.always_propose = always_propose
        self._match: dict[str, int] = {}  # request -> index of its reference

    def _reference(self, request: DraftRequest) -> list[int] | None:
        n = len(request.token_ids)
        index = self._match.get(request.req_id)
        if index is None:
            index = next(
                (i for i, r in enumerate(self.references) if r[:n] == request.token_ids), -1
            )
            self._match[request.req_id] = index
        if index < 0:
            return None
        ref = self.references[index]
        # Diverged from the reference (the target's tokens changed): nothing to propose.
        if n > len(ref) or ref[n - 1] != request.token_ids[-1]:
            return None
        return ref

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        out = {}
        for request in requests:
            ref = self._reference(request)
            n = len(request.token_ids)
            if ref is None:
                if self.always_propose:
                    wrong = (request.token_ids[-1] + 1) % self.vocab_size
                    out[request.req_id] = [wrong] * self.num_speculative_tokens
                continue
            drafts = []
            for token in ref[n : n + self.num_speculative_tokens]:
                if self.rng.random() >= self.acceptance_rate:
                    token = (token + 1) % self.vocab_size  # a wrong token: rejected
                drafts.append(token)
            if drafts:
                out[request.req_id] = drafts
        return out

    def remove(self, req_id: str) -> None:
        self._match.pop(req_id, None)
