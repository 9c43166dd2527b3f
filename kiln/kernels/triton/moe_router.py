"""The router's softmax, top-k and renormalisation in one launch (twin of reference.moe_route):
one program per token holds its row of expert logits in registers, takes the softmax in fp32,
picks the k largest one at a time (the lowest index among equals, as a stable sort would) and
writes the weights, rounded to the model dtype as transformers rounds them, and the ids. A
decode step of a 48-layer model otherwise spends five small launches a layer on this. The
SIGMOID variant (a constexpr: the softmax routers compile as before) is DeepSeek-V3's and
GLM-4.5's router: sigmoid scores, the choice on scores plus a bias within the best groups of
experts, the unbiased scores as weights (reference.sigmoid_group_route)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import SigmoidRouting


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
def sigmoid_route_row(
    row_ptr,  # one token's [num_experts] logits
    bias_ptr,  # [num_experts] fp32 e_score_correction_bias
    num_experts,
    group_size,  # num_experts // N_GROUP
    scaling,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_G: tl.constexpr,  # N_GROUP to a power of two
):
    """route_row's result under sigmoid_group_route: groups scored by their two best biased
    scores one group at a time (N_GROUP is small: 1 to 8 in the released models), the others
    masked out, then the top k of what is left, lowest index among equals."""
    experts = tl.arange(0, BLOCK_E)
    mask = experts < num_experts
    logits = tl.load(row_ptr + experts, mask=mask, other=0.0).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    bias = tl.load(bias_ptr + experts, mask=mask, other=0.0).to(tl.float32)
    choice = tl.where(mask, scores + bias, -float("inf"))
    if TOPK_GROUP < N_GROUP:
        group = experts // group_size
        groups = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), -float("inf"), dtype=tl.float32)
        for g in tl.static_range(N_GROUP):
            in_group = tl.where(group == g, choice, -float("inf"))
            first = tl.max(in_group, axis=0)
            first_id = tl.min(tl.where(in_group == first, experts, BLOCK_E), axis=0)
            second = tl.max(tl.where(experts == first_id, -float("inf"), in_group), axis=0)
            group_scores = tl.where(groups == g, first + second, group_scores)
        kept = tl.zeros((BLOCK_E,), dtype=tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(group_scores, axis=0)
            best_group = tl.min(tl.where(group_scores == best, groups, BLOCK_G), axis=0)
            kept = kept | (group == best_group)
            group_scores = tl.where(groups == best_group, -float("inf"), group_scores)
        choice = tl.where(kept, choice, -float("inf"))
    slots = tl.arange(0, BLOCK_K)
    chosen = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_ids = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(choice, axis=0)
        best_id = tl.min(tl.where(choice == best, experts, BLOCK_E), axis=0)
        weight = tl.sum(tl.where(experts == best_id, scores, 0.0), axis=0)
        chosen = tl.where(slots == k, weight, chosen)
        chosen_ids = tl.where(slots == k, best_id.to(tl.int64), chosen_ids)
        choice = tl.where(experts == best_id, -float("inf"), choice)
    if RENORMALIZE:
        chosen = chosen / (tl.sum(tl.where(slots < TOP_K, chosen, 0.0), axis=0) + 1e-20)
    return chosen * scaling, chosen_ids


@triton.jit
def _route_kernel(
    logits_ptr,  # [num_tokens, num_experts]
    weights_ptr,  # [num_tokens, TOP_K] fp32
    ids_ptr,  # [num_tokens, TOP_K] int64
    bias_ptr,  # SIGMOID: [num_experts] fp32
    num_experts,
    stride_logits,
    group_size,
    scaling,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SIGMOID: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    if SIGMOID:
        chosen, chosen_ids = sigmoid_route_row(
            logits_ptr + token * stride_logits, bias_ptr, num_experts, group_size, scaling,
            TOP_K, RENORMALIZE, N_GROUP, TOPK_GROUP, BLOCK_E, BLOCK_K, BLOCK_G,
        )  # fmt: skip
    else:
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
    grouped: SigmoidRouting | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, top_k] fp32 weights, [.., top_k] ids)
    """See reference.moe_route. The kernel rounds the weights when `dtype` is the logits' own
    (the model's); other dtypes round after it; `grouped` routing's weights stay fp32."""
    num_tokens, num_experts = router_logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens == 0:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    # One warp holds a few hundred logits: its top-k's 2k reductions stay warp shuffles, with
    # no shared-memory round trip and barrier each (they run one after another).
    if grouped is not None:
        if num_experts % grouped.n_group or not 0 < grouped.topk_group <= grouped.n_group:
            raise ValueError(
                f"{num_experts} experts in n_group={grouped.n_group} groups, "
                f"topk_group={grouped.topk_group}"
            )
        _route_kernel[(num_tokens,)](
            router_logits, weights, ids, grouped.bias, num_experts, router_logits.stride(0),
            num_experts // grouped.n_group, float(grouped.scaling),
            TOP_K=top_k, RENORMALIZE=renormalize, ROUND=False, BLOCK_E=block_e,
            BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=True,
            N_GROUP=grouped.n_group, TOPK_GROUP=grouped.topk_group,
            BLOCK_G=triton.next_power_of_2(grouped.n_group), num_warps=1 if block_e <= 512 else 4,
        )  # fmt: skip
        return weights, ids
    _route_kernel[(num_tokens,)](
        router_logits, weights, ids, router_logits, num_experts, router_logits.stride(0), 1, 1.0,
        TOP_K=top_k, RENORMALIZE=renormalize, ROUND=dtype == router_logits.dtype,
        BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k), SIGMOID=False, N_GROUP=1,
        TOPK_GROUP=1, BLOCK_G=1, num_warps=1 if block_e <= 512 else 4,
    )  # fmt: skip
    if dtype != router_logits.dtype and dtype != torch.float32:
        weights = weights.to(dtype).float()
    return weights, ids
