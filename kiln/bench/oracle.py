"""The oracle: a measuring instrument that drafts from a known continuation, each draft right
with a set probability, for `kiln bench` and the tests.

Random weights accept nothing a real drafter proposes, so speed as a function of acceptance is
measured with this. It is not a speculative_config method (with `accept_by_draw` its output is
not the model's text): `oracle_config` makes a SpeculativeConfig whose `instrument` it is, which
the proposer factory builds in a method's place. Two ways to set the acceptance:

- references (the exactness tests): given the target's own greedy outputs from a plain run,
  propose the next K reference tokens, each replaced by a wrong one with probability
  1 - acceptance_rate; the target's verification decides. The mean acceptance length is then
  1 + a + a^2 + ... + a^K as long as the run's greedy tokens equal the references, which random
  bf16 weights do not keep (near-uniform logits: a last-bit difference between two step shapes
  changes a token, and every later draft is rejected).
- `accept_by_draw` (the speed benchmark): the oracle itself decides how many of its K drafts the
  verification accepts, by a draw with P(at least i accepted) = a^i, and the runner emits those
  drafts and the target's token after them. The target's forward, verification and bookkeeping
  run exactly as for any proposer (the tokens' values do not change a step's cost); only which
  rows count as accepted comes from the draw. The output is then not the target's text.
  The draws are a golden-ratio sequence from a seeded start rather than independent uniforms, so
  the measured mean over a run of ~100 steps lands within ~0.02 of the set length instead of
  ~0.15 (the spread of ~100 independent geometric draws).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from kiln.spec_decode.config import SpeculativeConfig
from kiln.spec_decode.proposer import DraftRequest, Proposer

_GOLDEN = 0.6180339887498949  # frac of the golden ratio: the most evenly spread additive sequence


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


def num_accepted_for_draw(u: float, acceptance_rate: float, k: int) -> int:
    """The number n of K drafts accepted for a uniform u in [0, 1): the largest n with
    u < a^n, so P(n >= i) = a^i, as for drafts each right with probability a until the first
    wrong one."""
    n, threshold = 0, acceptance_rate
    while n < k and u < threshold:
        n += 1
        threshold *= acceptance_rate
    return n


class OracleProposer(Proposer):
    def __init__(
        self,
        num_speculative_tokens: int,
        references: list[list[int]],
        acceptance_rate: float,
        vocab_size: int,
        seed: int = 0,
        always_propose: bool = False,
        accept_by_draw: bool = False,
    ) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.references = [list(r) for r in references]
        self.acceptance_rate = acceptance_rate
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)
        # Without a (matching) reference, propose K wrong tokens anyway: every step then has the
        # verification shape, e.g. to record references with the numerics of verification steps.
        self.always_propose = always_propose
        self.decides_acceptance = accept_by_draw
        self._draw = self.rng.random()  # the golden-ratio sequence's seeded start
        self._num_accepted: dict[str, int] = {}  # request -> drafts its next verification accepts
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
        if self.decides_acceptance:
            return self._propose_by_draw(requests)
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

    def _propose_by_draw(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """K drafts for every request (their values are arbitrary: the draw accepts them), and
        how many of them its next verification accepts."""
        k, out = self.num_speculative_tokens, {}
        for request in requests:
            self._draw = (self._draw + _GOLDEN) % 1.0
            self._num_accepted[request.req_id] = num_accepted_for_draw(
                self._draw, self.acceptance_rate, k
            )
            last = request.token_ids[-1]
            out[request.req_id] = [(last + 1 + i) % self.vocab_size for i in range(k)]
        return out

    def accepted_rows(self, req_ids: Sequence[str], num_drafts: Sequence[int]) -> list[bool]:
        """`decides_acceptance`: per verification row (each request's drafts, then its bonus
        row), whether the row's draft counts as accepted: the first n drafts of a request, n
        its draw (fewer if the scheduler verified fewer drafts than were proposed)."""
        rows = []
        for req_id, k in zip(req_ids, num_drafts):
            n = min(self._num_accepted.pop(req_id, 0), k)
            rows += [True] * n + [False] * (k + 1 - n)
        return rows

    def remove(self, req_id: str) -> None:
        self._match.pop(req_id, None)
        self._num_accepted.pop(req_id, None)


@dataclass(frozen=True)
class Oracle:
    """The oracle's settings: a SpeculativeConfig's `instrument` (see oracle_config)."""

    acceptance_rate: float = 1.0
    """The probability that each proposed token is the reference's (accept_by_draw: that each
    draft is accepted, until the first that is not)."""
    token_ids: list[list[int]] = field(default_factory=list)
    """Reference sequences (prompt + greedy continuation) that requests are matched to."""
    always_propose: bool = False
    """Propose K wrong tokens where no reference matches (verification-shaped steps)."""
    accept_by_draw: bool = False
    """The oracle's own seeded draw decides how many drafts each verification accepts
    (P(at least i) = acceptance_rate^i), not the target: the measured acceptance length is the
    one set whatever the weights do. No references needed; the text is not the target's."""

    def __post_init__(self) -> None:
        if not 0.0 <= self.acceptance_rate <= 1.0:
            raise ValueError(
                f"Oracle.acceptance_rate must be in [0, 1], got {self.acceptance_rate!r}"
            )

    def build(self, num_speculative_tokens: int, vocab_size: int) -> OracleProposer:
        return OracleProposer(
            num_speculative_tokens,
            self.token_ids,
            self.acceptance_rate,
            vocab_size,
            always_propose=self.always_propose,
            accept_by_draw=self.accept_by_draw,
        )


def oracle_config(
    num_speculative_tokens: int,
    oracle: Oracle,
    num_speculative_tokens_by_batch_size: dict[int, int] | None = None,
    disable_by_batch_size: int | None = None,
) -> SpeculativeConfig:
    """An EngineConfig's speculative_config that runs `oracle` as the proposer, K drafts a step
    under SpeculativeConfig's K-by-batch policy (its two keys as there). In-process engines
    only: the instrument is no JSON."""
    return SpeculativeConfig(
        method="oracle",
        num_speculative_tokens=num_speculative_tokens,
        num_speculative_tokens_by_batch_size=num_speculative_tokens_by_batch_size,
        disable_by_batch_size=disable_by_batch_size,
        instrument=oracle,
    )


def oracle_at_length(num_speculative_tokens: int, mean_length: float) -> SpeculativeConfig:
    """The speed benchmark's oracle: K drafts a step, accepted by its own draw at the rate whose
    mean acceptance length is `mean_length` (1 to K + 1 tokens a verification)."""
    rate = acceptance_rate_for_length(mean_length, num_speculative_tokens)
    return oracle_config(num_speculative_tokens, Oracle(rate, accept_by_draw=True))
