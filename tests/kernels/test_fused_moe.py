"""The fused-MoE grouped GEMM (kiln.kernels.triton.fused_moe) against its twin, the loop over
experts in kiln.kernels.reference, under the interpreter at tiny shapes: uneven expert loads
(one expert with no tokens, one with more than a row block), top-1 and top-2, fp32 and bf16;
and the sort by expert itself."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference

# The module, not the function the package exports under its name.
triton_moe = importlib.import_module("kiln.kernels.triton.fused_moe")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(num_tokens: int, top_k: int, dtype: torch.dtype, experts: int = 4):
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    hidden, inter = 48, 40  # not multiples of the blocks: the masks are exercised
    x = torch.randn(num_tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.4
    w2 = torch.randn(experts, hidden, inter, generator=gen) * 0.4
    # Expert 3 never chosen; expert 0 by most tokens (more than one 16-row block).
    ids = torch.randint(0, 3, (num_tokens, top_k), generator=gen)
    ids[:, 0] = 0
    if top_k > 1:
        ids[:, 1] = torch.randint(1, 3, (num_tokens,), generator=gen)
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    peak = want.float().abs().max()
    assert peak > 0.1  # not a vacuous zero-vs-zero comparison
    # bf16: both round gate_up and the activation to bf16, their sums in other orders.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol * peak, rtol=0)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (5, 2), (21, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_equals_the_loop_over_experts(num_tokens, top_k, dtype) -> None:
    args = _case(num_tokens, top_k, dtype)
    _close(triton_moe.fused_moe(*args), reference.fused_moe(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float8_experts_equal_the_loop_and_stay_near_the_unquantized(dtype) -> None:
    from kiln.layers.moe import quantize_experts_fp8

    x, w13, w2, weights, ids = _case(21, 2, dtype)
    (w13_fp8, s13), (w2_fp8, s2) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
    assert w13_fp8.dtype == torch.float8_e4m3fn and s13.shape == (4,)
    args = (x, w13_fp8, w2_fp8, weights, ids, s13, s2)
    want = reference.fused_moe(*args).float()
    _close(triton_moe.fused_moe(*args), want, dtype)
    exact = reference.fused_moe(x, w13, w2, weights, ids).float()
    # float8's noise, not another function
    assert (want - exact).abs().max() < 0.1 * want.abs().max()


def test_the_gpus_prefill_tiles_equal_the_loop() -> None:
    args = _case(21, 2, torch.float32)
    got = triton_moe.fused_moe_tiled(*args, None, None, triton_moe._PREFILL_TILES)
    _close(got, reference.fused_moe(*args), torch.float32)


def test_align_groups_pairs_by_expert_padded_to_the_block() -> None:
    ids = torch.tensor([[2, 0], [0, 2], [2, 1]])
    pairs, block_experts, num_rows = triton_moe.align_by_expert(ids, 4, 4)
    pad = ids.numel()
    # Expert 0: pairs 1, 2; expert 1: pair 5; expert 2: pairs 0, 3, 4; each padded to 4 rows.
    assert pairs[:12].tolist() == [1, 2, pad, pad, 5, pad, pad, pad, 0, 3, 4, pad]
    assert block_experts[:3].tolist() == [0, 1, 2]
    assert num_rows.item() == 12 and (pairs[12:] == pad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_another_ranks_experts_add_nothing(dtype) -> None:
    """Expert parallelism: ids outside [0, num_experts) (-1: another rank's expert) are
    skipped by both twins, so a rank holding experts 2-3 of 0-3 (local ids 0-1) gives exactly
    the part of the whole output those two experts make, zeros for tokens of neither."""
    x, w13, w2, weights, ids = _case(21, 2, dtype)
    local = torch.where(ids >= 2, ids - 2, -1)
    got = triton_moe.fused_moe(x, w13[2:], w2[2:], weights, local)
    want = reference.fused_moe(x, w13[2:], w2[2:], weights, local)
    _close(want, reference.fused_moe(x, w13, w2, weights * (ids >= 2), ids), dtype)
    _close(got, want, dtype)
    neither = (ids < 2).all(dim=1)
    assert neither.any() and not got[neither].any()
    _, block_experts, num_rows = triton_moe.align_by_expert(local, 2, 16)
    assert block_experts[: num_rows.item() // 16].tolist()[-1] == 2  # the skipped run is last
