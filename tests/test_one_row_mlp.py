"""The FP8 MLP block of one row in one launch (kernels.triton.one_row_mlp): the same bits as its
two launches (small_batch_linear's gate_up, then down), close to the reference, its counters back
at zero after every launch (so a graph replays it), and the two-launch path wherever it does not
apply. Under the interpreter on the CPU at tiny shapes; on a GPU also at Llama-3.1-8B's, replayed
in a CUDA graph."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton import one_row_mlp, small_batch_linear, split_k

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU (interpreter run)")
REL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


def _weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 0, n)[:, None]
    w_fp8, w_scale = reference.quantize_fp8(w, None)
    return w_fp8.to(DEVICE), w_scale.view(-1).to(DEVICE)


def _block(k: int, n: int, dtype: torch.dtype, rows: int = 1, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(rows, k, generator=gen)).to(dtype).to(DEVICE)
    residual = torch.randn(rows, k, generator=gen).to(dtype).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(dtype).to(DEVICE)
    gate_up, gate_up_scale = _weight(2 * n, k, gen)
    down, down_scale = _weight(k, n, gen)
    return x, residual, norm_weight, gate_up, gate_up_scale, down, down_scale


def _two_launches(x, residual, norm_weight, gate_up, gate_up_scale, gu_in, down, down_scale, d_in):
    """small_batch_linear's two launches: gate_up (norm, SiLU-mul), then down."""
    act, act_scale, summed = triton_ops.add_rms_norm_linear_silu_mul_fp8(
        x, residual, norm_weight, 1e-5, gate_up, gate_up_scale, gu_in, d_in
    )
    assert act_scale is None  # one row: down quantizes the model-dtype activation itself
    return triton_ops.fp8_linear(act, down, down_scale, d_in), summed


def _sync_words() -> torch.Tensor:
    return split_k.counters(DEVICE, one_row_mlp._SYNC_WORDS, "one_row_mlp")


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=on_gpu)]
)
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("swap_ab", [True, False])
def test_one_launch_equals_two_and_the_reference(
    monkeypatch, dtype, static, with_residual, swap_ab
) -> None:
    """K and N not multiples of the interpreter's tiles (masked tails), down split over K: the
    one launch stores the two launches' bits, twice in a row (its counters reset)."""
    monkeypatch.setattr(one_row_mlp, "ENABLED", 1)
    monkeypatch.setattr(small_batch_linear, "SWAP_AB", swap_ab)
    x, residual, norm_weight, gate_up, gate_up_scale, down, down_scale = _block(40, 72, dtype)
    residual = residual if with_residual else None
    gu_in = torch.tensor(0.02, device=DEVICE) if static else None
    d_in = torch.tensor(0.01, device=DEVICE) if static else None
    weights = (gate_up, gate_up_scale, gu_in, down, down_scale, d_in)
    want, want_sum = _two_launches(x, residual, norm_weight, *weights)
    launches = []
    real_launch = one_row_mlp._launch
    monkeypatch.setattr(one_row_mlp, "_launch", lambda *a: launches.append(1) or real_launch(*a))
    for _ in range(2):
        got, got_sum = triton_ops.add_rms_norm_mlp_fp8(x, residual, norm_weight, 1e-5, *weights)
        assert torch.equal(got, want) and torch.equal(got_sum, want_sum)
        assert torch.equal(_sync_words().cpu(), torch.zeros(one_row_mlp._SYNC_WORDS))
    assert len(launches) == 2
    cpu = [t.cpu() if t is not None else None for t in (x, residual, norm_weight, *weights)]
    ref, ref_sum = reference.add_rms_norm_mlp_fp8(*cpu[:3], 1e-5, *cpu[3:])
    assert torch.equal(got_sum.cpu(), ref_sum)
    torch.testing.assert_close(
        got.cpu().float(), ref.float(), rtol=0, atol=REL[dtype] * float(ref.abs().max())
    )


def test_off_or_several_rows_take_the_two_launches(monkeypatch) -> None:
    """KILN_ONE_ROW_MLP off, or more than one row: the kernel is not launched and the result is
    the two-launch composition's."""
    x, residual, norm_weight, gate_up, gate_up_scale, down, down_scale = _block(
        40, 72, torch.float32, rows=3, seed=1
    )
    monkeypatch.setattr(one_row_mlp, "_launch", lambda *a: pytest.fail("the one-launch kernel ran"))
    for enabled, rows in ((True, 3), (False, 1)):
        monkeypatch.setattr(one_row_mlp, "ENABLED", int(enabled))
        xs, res = x[:rows], residual[:rows]
        got, got_sum = triton_ops.add_rms_norm_mlp_fp8(
            xs, res, norm_weight, 1e-5, gate_up, gate_up_scale, None, down, down_scale, None
        )
        act, act_scale, summed = triton_ops.add_rms_norm_linear_silu_mul_fp8(
            xs, res, norm_weight, 1e-5, gate_up, gate_up_scale, None, None
        )
        want = (
            triton_ops.fp8_linear(act, down, down_scale, None)
            if act_scale is None
            else triton_ops.fp8_matmul(act, act_scale, down, down_scale, None, x.dtype)
        )
        assert torch.equal(got, want) and torch.equal(got_sum, summed)


@on_gpu
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("mode", [1, 2])  # roles by ticket; the cooperative grid
def test_llama8b_block_in_a_graph(monkeypatch, static, mode) -> None:
    """Llama-3.1-8B's MLP (4096 -> 2 x 14336 -> 4096) at the engine's tiles: the one launch
    captured in a CUDA graph and replayed stores the two launches' bits every time (new inputs
    between replays); a wrong hand-off (down reading a half-written activation) or counters left
    non-zero would show here."""
    monkeypatch.setattr(one_row_mlp, "ENABLED", mode)
    x, residual, norm_weight, gate_up, gate_up_scale, down, down_scale = _block(
        4096, 14336, torch.bfloat16, seed=2
    )
    gu_in = torch.tensor(0.05, device=DEVICE) if static else None
    d_in = torch.tensor(0.02, device=DEVICE) if static else None
    scales = (gate_up, gate_up_scale, gu_in, down, down_scale, d_in)
    triton_ops.add_rms_norm_mlp_fp8(x, residual, norm_weight, 1e-5, *scales)  # compile, counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got, got_sum = triton_ops.add_rms_norm_mlp_fp8(x, residual, norm_weight, 1e-5, *scales)
    gen = torch.Generator(device="cuda").manual_seed(3)
    for _ in range(20):
        x.copy_(3 * torch.randn(x.shape, device="cuda", generator=gen))
        graph.replay()
        want, want_sum = _two_launches(x, residual, norm_weight, *scales)
        assert torch.equal(got, want) and torch.equal(got_sum, want_sum)
    assert torch.equal(_sync_words().cpu(), torch.zeros(one_row_mlp._SYNC_WORDS))


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("down_bias", [False, True])
def test_the_mlp_layers_take_the_one_launch(monkeypatch, static, down_bias) -> None:
    """Linear.silu_mul_into with plain FP8 gate_up and down (Fp8LinearMethod): one row runs the
    one launch, with the two launches' result; a down projection with a bias composes."""
    from kiln.layers.linear import Linear
    from kiln.quantization.fp8 import Fp8LinearMethod

    gen = torch.Generator().manual_seed(4)
    scheme = ("static", 0.02) if static else ("dynamic", None)
    gate_up = Linear(48, 64, output_sizes=[32, 32], method=Fp8LinearMethod(*scheme))
    down = Linear(32, 48, bias=down_bias, method=Fp8LinearMethod(*scheme))
    for layer, (n, k) in ((gate_up, (64, 48)), (down, (48, 32))):
        layer.weight_loader(layer.weight, None, torch.randn(n, k, generator=gen) * 0.3)
    if down_bias:
        down.bias.data = torch.randn(48, generator=gen)
    gate_up.to(DEVICE), down.to(DEVICE)
    x, residual = 3 * torch.randn(1, 48, generator=gen), torch.randn(1, 48, generator=gen)
    args = [t.to(DEVICE) for t in (x, residual, 1 + 0.1 * torch.randn(48, generator=gen))]
    launches = []
    real_launch = one_row_mlp._launch
    monkeypatch.setattr(one_row_mlp, "_launch", lambda *a: launches.append(1) or real_launch(*a))
    results = {}
    for enabled in (False, True):
        monkeypatch.setattr(one_row_mlp, "ENABLED", int(enabled))
        results[enabled] = gate_up.silu_mul_into(triton_ops, down, *args, 1e-5)
    assert len(launches) == (0 if down_bias else 1)
    for got, want in zip(results[True], results[False]):
        assert torch.equal(got, want)
