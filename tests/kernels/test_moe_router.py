"""The fused router (kiln.kernels.triton.moe_router) against its twin, reference.moe_route
(softmax in fp32, top-k, renormalisation, rounding to the model dtype), under the interpreter:
expert counts not a power of two, top-1 to top-8, with and without renormalisation."""

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
