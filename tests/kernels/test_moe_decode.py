"""The small-batch MoE kernels (kiln.kernels.triton.moe_decode) against their twin,
reference.fused_moe_decode, under the interpreter at tiny shapes (widths not multiples of the
tiles, so the masks are exercised): one to sixteen tokens, top-1 and top-2, fp32 and fp16,
float8 experts with per-expert and per-channel scales; and the twin against the loop over experts
(reference.fused_moe), the oracle the models' tests hold to transformers."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.layers.moe import quantize_experts_fp8
from tests.kernels.moe_checks import close_to_peak as _close

moe_decode = importlib.import_module("kiln.kernels.triton.moe_decode")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# bf16 on the GPU only: the interpreter has no bf16 arithmetic of its own.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
HIDDEN, INTER, EXPERTS = 48, 40, 4


def _case(num_tokens: int, top_k: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, top_k, generator=gen)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 2), (3, 2), (16, 2)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_kernels_equal_their_twin(num_tokens, top_k, dtype) -> None:
    args = _case(num_tokens, top_k, dtype)
    got = moe_decode.fused_moe_decode(*args)
    assert got.dtype == dtype and got.shape == (num_tokens, HIDDEN)
    _close(got, reference.fused_moe_decode(*args), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_twin_equals_the_loop_over_experts(dtype) -> None:
    args = _case(5, 2, dtype)
    _close(reference.fused_moe_decode(*args), reference.fused_moe(*args), dtype)


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_float8_experts_equal_the_twin(per_channel, dtype) -> None:
    x, w13, w2, weights, ids = _case(3, 2, dtype)
    (w13_fp8, s13), (w2_fp8, s2) = quantize_experts_fp8(w13), quantize_experts_fp8(w2)
    if per_channel:  # the same codes, a scale per output row: each row's own scale differs
        rows13 = torch.rand(EXPERTS, 2 * INTER, device=DEVICE) + 0.5
        rows2 = torch.rand(EXPERTS, HIDDEN, device=DEVICE) + 0.5
        s13, s2 = s13[:, None] * rows13, s2[:, None] * rows2
    args = (x, w13_fp8, w2_fp8, weights, ids, s13, s2)
    want = reference.fused_moe_decode(*args)
    _close(moe_decode.fused_moe_decode(*args), want, dtype)
    if not per_channel:  # float8's noise, not another function; and the loop's meaning
        exact = reference.fused_moe_decode(x, w13, w2, weights, ids)
        assert (want.float() - exact.float()).abs().max() < 0.1 * exact.float().abs().max()
        _close(want, reference.fused_moe(*args), dtype)


@pytest.mark.parametrize(
    "tiles",
    [(16, 256, 4, 32, 256, 4, 3, 1), (8, 512, 8, 16, 128, 4, 2, 0), (8, 16, 4, 8, 16, 4, 1, 0)],
)
def test_the_gpus_tiles_equal_the_twin(tiles) -> None:
    """Tiles the GPU may run: BLOCK_K wider than the hidden size (one masked step)."""
    args = _case(2, 2, torch.float32)
    got = moe_decode.fused_moe_decode_tiled(*args, None, None, tiles)
    _close(got, reference.fused_moe_decode(*args), torch.float32)


def test_a_long_reduction_split_into_chunks_equals_the_twin(monkeypatch) -> None:
    """The split down variant's reduction in chunks (Mixtral's 14336 in 2048s; here 40 in
    three 16s), each chunk's rows summed after."""
    monkeypatch.setattr(moe_decode, "_MAX_K_CHUNK", 16)
    args = _case(3, 2, torch.float32)
    got = moe_decode.fused_moe_decode_tiled(*args, None, None, (8, 16, 4, 8, 16, 4, 1, 0))
    _close(got, reference.fused_moe_decode(*args), torch.float32)


def test_enough_programs_for_every_sm_at_batch_1() -> None:
    # Qwen3-30B-A3B: 8 pairs x 768 columns (gate_up), 1 token x 2048 columns (down); 132 SMs.
    device = torch.device("cpu")
    assert 8 * -(-768 // moe_decode._block_n(8, 768, device)) >= 2 * 132  # gate_up
    assert -(-2048 // moe_decode._block_n(1, 2048, device)) >= 2 * 132 - 8  # down: 256


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_captures_the_decode_kernels() -> None:
    """No host sync: the whole call is captured and replays to the eager result."""
    x, w13, w2, weights, ids = _case(4, 2, torch.bfloat16)
    eager = moe_decode.fused_moe_decode(x, w13, w2, weights, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode.fused_moe_decode(x, w13, w2, weights, ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)


def _biases(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    b13 = torch.randn(EXPERTS, 2 * INTER, generator=gen) * 0.5
    b2 = torch.randn(EXPERTS, HIDDEN, generator=gen) * 0.5
    return b13.to(dtype).to(DEVICE), b2.to(dtype).to(DEVICE)


# gpt-oss's (alpha, limit); the limit low enough that the tiny case's gates and ups clip.
SWIGLU = (1.702, 2.0)


@pytest.mark.parametrize("fused_sum", [1, 0])
@pytest.mark.parametrize("per_channel_fp8", [None, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_biased_clamped_experts_equal_the_twin(fused_sum, per_channel_fp8, dtype) -> None:
    """gpt-oss's experts (biases on both projections, the clamped SwiGLU) on the decode
    kernels, both down variants, model-dtype and per-channel float8 weights; the twin against
    the loop over experts, which the gpt-oss model tests hold to transformers."""
    x, w13, w2, weights, ids = _case(3, 2, dtype)
    b13, b2 = _biases(dtype)
    s13 = s2 = None
    if per_channel_fp8:
        (w13, s13), (w2, s2) = quantize_experts_fp8(w13, True), quantize_experts_fp8(w2, True)
    args = (x, w13, w2, weights, ids, s13, s2)
    extra = {"w13_bias": b13, "w2_bias": b2, "swiglu": SWIGLU}
    want = reference.fused_moe_decode(*args, b13, b2, SWIGLU)
    tiles = (8, 16, 4, 8, 16, 4, 1, fused_sum)
    _close(moe_decode.fused_moe_decode_tiled(*args, tiles, **extra), want, dtype)
    unbiased = reference.fused_moe_decode(*args)
    assert (want.float() - unbiased.float()).abs().max() > 0.1 * want.float().abs().max()
    if dtype == torch.float32:  # the twin keeps the down product unrounded; the loop rounds it
        _close(want, reference.fused_moe(*args, b13, b2, SWIGLU), dtype)


@pytest.mark.parametrize("num_tokens,top_k,num_experts", [(1, 2, 4), (3, 3, 6), (16, 1, 5)])
@pytest.mark.parametrize("variant", ["plain", "biased", "shared", "shared_split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_norm_and_routing_inside_the_kernel_equal_the_twin(
    num_tokens, top_k, num_experts, variant, dtype, monkeypatch
) -> None:
    """fused_moe_decode_routed: the residual stream normed, the router's logits softmaxed and
    top-k'd inside the gate_up launch (ids and weights written for the down launch); gpt-oss's
    biased clamped experts; a shared expert's gated output added by the last launch (the
    fused down kernel's, or the split one's sum)."""
    if variant == "shared_split":
        split = (8, 16, 4, 8, 16, 4, 1, 0)
        monkeypatch.setattr(moe_decode, "_INTERPRETER_TILES", split)
    gen = torch.Generator().manual_seed(num_tokens + top_k)
    x = (torch.randn(num_tokens, HIDDEN, generator=gen) * 3).to(dtype).to(DEVICE)
    norm_weight = (torch.rand(HIDDEN, generator=gen) + 0.5).to(dtype).to(DEVICE)
    logits = (torch.randn(num_tokens, num_experts, generator=gen) * 2).to(dtype).to(DEVICE)
    w13 = (torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(num_experts, HIDDEN, INTER, generator=gen) * 0.3).to(dtype)
    w13, w2 = w13.to(DEVICE), w2.to(DEVICE)
    b13 = b2 = swiglu = shared = None
    if variant.startswith("shared"):
        shared = (
            torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype).to(DEVICE),
            torch.randn(num_tokens, 1, generator=gen).to(dtype).to(DEVICE),
        )
    if variant == "biased":
        b13 = (torch.randn(num_experts, 2 * INTER, generator=gen) * 0.5).to(dtype).to(DEVICE)
        b2 = (torch.randn(num_experts, HIDDEN, generator=gen) * 0.5).to(dtype).to(DEVICE)
        swiglu = SWIGLU
    for renormalize in (False, True):
        args = (x, norm_weight, 1e-5, logits, top_k, renormalize, w13, w2, None, None)
        want = reference.fused_moe_decode_routed(*args, b13, b2, swiglu, shared)
        got = moe_decode.fused_moe_decode_routed(*args, b13, b2, swiglu, shared)
        _close(got, want, dtype)
    unnormed = reference.fused_moe_decode_routed(x, None, 1e-5, *args[3:], b13, b2, swiglu)
    assert (want.float() - unnormed.float()).abs().max() > 0.1 * want.float().abs().max()
    if shared is not None:
        alone = reference.fused_moe_decode_routed(*args, b13, b2, swiglu)
        added = torch.sigmoid(shared[1].float()) * shared[0].float()
        _close(want, alone.float() + added, dtype)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_a_cuda_graph_captures_the_routed_kernels() -> None:
    """The norm and routing inside the kernels: still no host sync, replayed exactly."""
    x, w13, w2, _, _ = _case(2, 2, torch.bfloat16)
    norm_weight = torch.ones(HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    logits = torch.randn(2, EXPERTS, device=DEVICE).to(torch.bfloat16)
    b13, b2 = _biases(torch.bfloat16)
    args = (x, norm_weight, 1e-6, logits, 2, True, w13, w2, None, None, b13, b2, SWIGLU)
    eager = moe_decode.fused_moe_decode_routed(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = moe_decode.fused_moe_decode_routed(*args)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured, eager, atol=0, rtol=0)
