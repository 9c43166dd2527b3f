"""The fused router (kiln.kernels.triton.moe_router) against its twin, reference.moe_route
(softmax in fp32, top-k, renormalisation, rounding to the model dtype), under the interpreter:
expert counts not a power of two, top-1 to top-8, with and without renormalisation; and the
sigmoid, biased, grouped routing of DeepSeek-V3 and GLM-4.5 against transformers' own
(Glm4MoeTopkRouter.forward transcribed, and the module itself)."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference

moe_router = importlib.import_module("kiln.kernels.triton.moe_router")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("num_experts,top_k", [(4, 1), (8, 2), (60, 4), (128, 8)])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_router_equals_its_twin(num_experts, top_k, renormalize, dtype) -> None:
    gen = torch.Generator().manual_seed(num_experts + top_k)
    logits = (torch.randn(7, num_experts, generator=gen) * 3).to(dtype).to(DEVICE)
    weights, ids = moe_router.moe_route(logits, top_k, renormalize, dtype)
    want_weights, want_ids = reference.moe_route(logits, top_k, renormalize, dtype)
    assert ids.dtype == want_ids.dtype and weights.dtype == torch.float32
    assert torch.equal(ids, want_ids)  # the same experts, largest first
    # One rounding step of the model dtype: exp's order of operations differs.
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(weights, want_weights, atol=tol, rtol=0)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(7, device=DEVICE), atol=2e-3, rtol=0)


def test_rounds_to_a_dtype_other_than_the_logits() -> None:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    weights, _ = moe_router.moe_route(logits, 2, True, torch.bfloat16)
    assert torch.equal(weights, weights.to(torch.bfloat16).float())
    want, _ = reference.moe_route(logits, 2, True, torch.bfloat16)
    torch.testing.assert_close(weights, want, atol=1e-2, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_captures_the_router() -> None:
    logits = torch.randn(4, 128, device=DEVICE).to(torch.bfloat16)
    eager = moe_router.moe_route(logits, 8, True, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_router.moe_route(logits, 8, True, torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[1], eager[1]) and torch.equal(captured[0], eager[0])


def hf_route(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scaling):
    """transformers' Glm4MoeTopkRouter.forward (DeepseekV3's get_topk_indices and
    route_tokens_to_experts) after its linear, line for line."""
    num_experts = logits.shape[-1]
    scores = logits.float().sigmoid()
    scores_for_choice = scores + bias
    group_scores = (
        scores_for_choice.view(-1, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(-1, n_group, num_experts // n_group)
        .reshape(-1, num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if norm_topk_prob:
        topk_weights /= topk_weights.sum(dim=-1, keepdim=True) + 1e-20
    return topk_weights * scaling, topk_indices


def _by_expert(weights, ids):
    """Each token's (ids, weights) ordered by expert id: the slots' order is free."""
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize(
    "num_experts,top_k,n_group,topk_group",
    [(16, 4, 1, 1), (24, 4, 4, 2), (64, 8, 8, 4), (40, 6, 5, 3), (12, 2, 3, 3)],
)
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_grouped_router_equals_transformers(
    num_experts, top_k, n_group, topk_group, renormalize, dtype
) -> None:
    gen = torch.Generator().manual_seed(num_experts * 7 + top_k)
    logits = (torch.randn(9, num_experts, generator=gen) * 2).to(dtype).to(DEVICE)
    # A bias as large as the scores' spread: it changes which experts and groups win.
    bias = (torch.randn(num_experts, generator=gen) * 0.5).to(DEVICE)
    routing = reference.SigmoidRouting(bias, n_group, topk_group, scaling=2.5)
    want = _by_expert(*hf_route(logits, bias, top_k, n_group, topk_group, renormalize, 2.5))
    for route in (reference.moe_route, moe_router.moe_route):
        weights, ids = route(logits, top_k, renormalize, dtype, routing)
        assert weights.dtype == torch.float32  # transformers weights the experts in fp32
        got_ids, got_weights = _by_expert(weights, ids)
        assert torch.equal(got_ids, want[0]), route
        torch.testing.assert_close(got_weights, want[1], atol=1e-6, rtol=1e-6)
    # The biased choice is not the unbiased one: the test can tell a router that ignores it.
    plain = torch.topk(logits.float(), top_k, dim=-1)[1].sort(dim=-1)[0]
    assert not torch.equal(plain, want[0])


def test_sigmoid_router_equals_the_transformers_module() -> None:
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    config = Glm4MoeConfig(hidden_size=32, n_routed_experts=32, num_experts_per_tok=4,
                           n_group=4, topk_group=2, routed_scaling_factor=1.5,
                           norm_topk_prob=True)  # fmt: skip
    router = Glm4MoeTopkRouter(config)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(32, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(32, generator=gen) * 0.3)
    x = torch.randn(11, 32, generator=gen)
    logits, hf_weights, hf_ids = router(x)
    want = _by_expert(hf_weights, hf_ids)
    routing = reference.SigmoidRouting(router.e_score_correction_bias.to(DEVICE), 4, 2, 1.5)
    weights, ids = moe_router.moe_route(logits.to(DEVICE), 4, True, torch.float32, routing)
    got_ids, got_weights = _by_expert(weights.cpu(), ids.cpu())
    assert torch.equal(got_ids, want[0])
    torch.testing.assert_close(got_weights, want[1].detach(), atol=1e-6, rtol=1e-6)
