"""Verifying drafted tokens: speculative sampling that leaves the target's distribution unchanged.

A request that verifies K drafts has K + 1 *rows* of target logits: row i scores the position that
draft i would fill, row K the bonus position after the last draft. Per row (Leviathan et al. 2023,
Chen et al. 2023):

- a draft token d drawn from q is accepted with probability min(1, p(d) / q(d));
- at the first rejected row the token is drawn from norm(max(p - q, 0)) instead, and the rest of
  the drafts are dropped;
- if all K are accepted, the bonus row draws from p.

The emitted tokens are then distributed exactly as K + 1 draws from the target. A proposer that
picks its drafts deterministically (n-gram lookup, a greedy draft model) has a one-hot q: accept
with probability p(d), resample from p with d removed. Greedy rows accept a draft iff it is the
argmax, and emit the argmax: the same tokens as decoding without drafts.

Each row with a per-request generator draws from it alone (a uniform for the acceptance test, then
the exponential race of `random_sample` for the recovered token), so a seeded request's output
does not depend on what else is batched.
"""

from __future__ import annotations

import torch

from kiln.sampling.host_copy import to_device
from kiln.sampling.sampler import random_sample


def rejection_sample(
    draft_token_ids: list[int],  # [N]: the draft each row verifies; -1 for a bonus row
    greedy_ids: torch.Tensor | None,  # [N] target argmax; None when no row is greedy
    target_probs: torch.Tensor | None,  # [N, V] float32; None when every row is greedy
    is_greedy: torch.Tensor,  # [N] bool
    generators: list[torch.Generator | None],  # [N]
    draft_probs: torch.Tensor | None = None,  # [N, V] q of each draft; None: one-hot drafts
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [N] bool, recovered [N] int64
    """Per row: whether its draft is accepted, and the token to emit if it is not (or, for a bonus
    row, the token it emits). `emitted_tokens` turns these into each request's tokens."""
    device = is_greedy.device
    draft = to_device(draft_token_ids, torch.long, device)  # pinned: no wait for the stream
    has_draft = draft >= 0
    safe_draft = draft.clamp(min=0)[:, None]
    greedy = None
    if greedy_ids is not None:
        greedy = has_draft & (greedy_ids == draft), greedy_ids
    if target_probs is None:
        assert greedy is not None, "rows without target probs are greedy rows"
        return greedy
    r_accepted, r_recovered = _random_rows(
        target_probs, draft_token_ids, has_draft, safe_draft, generators, draft_probs
    )
    if greedy is None:
        return r_accepted, r_recovered
    accepted, recovered = greedy
    accepted = torch.where(is_greedy, accepted, r_accepted)
    return accepted, torch.where(is_greedy, recovered, r_recovered)


def _random_rows(
    probs: torch.Tensor,
    draft_token_ids: list[int],
    has_draft: torch.Tensor,
    safe_draft: torch.Tensor,
    generators: list[torch.Generator | None],
    draft_probs: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    n = probs.shape[0]
    p_d = probs.gather(1, safe_draft)[:, 0]
    q = torch.zeros_like(probs).scatter_(1, safe_draft, 1.0) if draft_probs is None else draft_probs
    q_d = q.gather(1, safe_draft)[:, 0]
    # Uniforms first, then the recovered draw: each row's generator is read in a fixed order.
    u = torch.rand(n, device=probs.device) if any(g is None for g in generators) else None
    if u is None:
        u = torch.empty(n, device=probs.device)
    for row, generator in enumerate(generators):
        if generator is not None and draft_token_ids[row] >= 0:
            u[row] = torch.rand(1, generator=generator, device=probs.device)[0]
    # u < p/q written without the division (q(d) > 0 for any d the drafter could pick).
    accepted = has_draft & (u * q_d < p_d)
    residual = (probs - q).clamp_(min=0)
    # p == q leaves no residual mass, but then a draft is never rejected: any row will do.
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(has_draft[:, None] & ~empty, residual, probs)
    return accepted, random_sample(residual, generators)


def emitted_tokens(
    num_drafts: list[int],  # per request, its rows are num_drafts[r] + 1 consecutive rows
    draft_token_ids: list[int],
    accepted: list[bool],
    recovered: list[int],
) -> list[list[int]]:
    """Each request's tokens: its accepted drafts, then the recovered (or bonus) token."""
    out = []
    row = 0
    for k in num_drafts:
        tokens = []
        for i in range(k + 1):
            if i < k and accepted[row + i]:
                tokens.append(draft_token_ids[row + i])
                continue
            tokens.append(recovered[row + i])
            break
        out.append(tokens)
        row += k + 1
    return out
