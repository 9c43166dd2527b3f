"""The router's softmax, top-k and renormalisation in one launch (twin of reference.moe_route):
one program per token holds its row of expert logits in registers, takes the softmax in fp32,
picks the k largest one at a time (the lowest index among equals, as a stable sort would) and
writes the weights, rounded to the model dtype as transformers rounds them, and the ids. A
decode step of a 48-layer model otherwise spends five small launches a layer on this."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def route_row(
    row_ptr,  # one token's [num_experts] logits
    num_experts,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,  # round the weights to the logits' dtype (the model's)
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """([BLOCK_K] fp32 weights, [BLOCK_K] int64 ids) of one token's top-k, slot k in lane k
    (the small-batch experts' kernel routes its own token with it: kiln.kernels.triton.
    moe_decode)."""
    experts = tl.arange(0, BLOCK_E)
    mask = experts < num_experts
    logits = tl.load(row_ptr + experts, mask=mask, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    probs = tl.where(mask, probs, -1.0)  # below every probability: never picked
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(probs, axis=0)
        best_id = tl.min(tl.where(probs == best, experts, BLOCK_E), axis=0)
        chosen = tl.where(slots == k, best, chosen)
        chosen_ids = tl.where(slots == k, best_id.to(tl.int64), chosen_ids)
        probs = tl.where(experts == best_id, -1.0, probs)
    if RENORMALIZE:
        chosen = chosen / tl.sum(tl.where(slots < TOP_K, chosen, 0.0), axis=0)
    if ROUND:
        chosen = chosen.to(row_ptr.dtype.element_ty).to(tl.float32)
    return chosen, chosen_ids


@triton.jit
def _route_kernel(
    logits_ptr,  # [num_tokens, num_experts]
    weights_ptr,  # [num_tokens, TOP_K] fp32
    ids_ptr,  # [num_tokens, TOP_K] int64
    num_experts,
    stride_logits,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    chosen, chosen_ids = route_row(
        logits_ptr + token * stride_logits, num_experts, TOP_K, RENORMALIZE, ROUND, BLOCK_E,
        BLOCK_K,
    )  # fmt: skip
    slots = tl.arange(0, BLOCK_K)
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, chosen, mask=slots < TOP_K)
    tl.store(ids_ptr + out, chosen_ids, mask=slots < TOP_K)


def moe_route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts] in the model dtype
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, top_k] fp32 weights, [.., top_k] ids)
    """See reference.moe_route. The kernel rounds the weights when `dtype` is the logits' own
    (the model's); other dtypes round after it."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    # One warp holds a few hundred logits: its top-k's 2k reductions stay warp shuffles, with
    # no shared-memory round trip and barrier each (they run one after another).
    _route_kernel[(num_tokens,)](
        router_logits, weights, ids, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, ROUND=dtype == router_logits.dtype,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=1 if block_e <= 512 else 4,
    )  # fmt: skip
    if dtype != router_logits.dtype and dtype != torch.float32:
        weights = weights.to(dtype).float()
    return weights, ids
