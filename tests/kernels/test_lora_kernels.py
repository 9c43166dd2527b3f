"""LoRA's shrink and expand kernels (kiln.kernels.triton.lora) against their twins
(reference.lora_shrink, reference.lora_expand): under TRITON_INTERPRET=1 at tiny shapes without a
GPU (fp32, fp16); with one, at Llama-3.1-8B's qkv and gate_up shapes in bf16 and inside a CUDA
graph."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels.triton import lora
from kiln.kernels.triton.lora import LoraPlan, expand_plan, shrink_plan
from kiln.lora.layers import LoRAInputs

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU (interpreter run)")
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 6e-2}

# (rank, slice_bounds, hidden): fused qkv-like (3 unequal slices, two boundaries inside one
# 64-column tile, a rank that is no power of two), gate_up-like (a hidden that is no multiple of
# the hidden step), one slice past one column tile, the largest rank over three slices.
CASES = [(12, (0, 40, 56, 72), 48), (8, (0, 24, 88), 40), (16, (0, 72), 64),
         (64, (0, 40, 56, 72), 48)]  # fmt: skip
NUM_SLOTS = 4


def _operands(t, rank, bounds, hidden, dtype, num_slots=NUM_SLOTS, seed=0, device=DEVICE):
    """x, lora_a, lora_b (scaled so y and the update are O(1)), token slots with -1 among them,
    and a base output to add to."""
    gen = torch.Generator().manual_seed(seed)
    slices = len(bounds) - 1
    x = torch.randn(t, hidden, generator=gen)
    lora_a = torch.randn(num_slots, slices * rank, hidden, generator=gen) * hidden**-0.5
    lora_b = torch.randn(num_slots, bounds[-1], rank, generator=gen) * rank**-0.5
    slots = torch.randint(-1, num_slots, (t,), generator=gen, dtype=torch.int32)
    out = torch.randn(t, bounds[-1], generator=gen)
    return [v.to(device, dtype) if v.is_floating_point() else v.to(device)
            for v in (x, lora_a, lora_b, slots, out)]  # fmt: skip


def _by_slot(slots: torch.Tensor) -> torch.Tensor:
    """The rows grouped by slot (stable), rows without an adapter last: LoRAInputs' order."""
    key = torch.where(slots < 0, slots.max() + 1, slots).cpu()
    return torch.sort(key, stable=True).indices.to(torch.int32).to(slots.device)


def _check(t, rank, bounds, hidden, dtype, shrink=None, expand=None, seed=0, order=False) -> None:
    x, lora_a, lora_b, slots, out = _operands(t, rank, bounds, hidden, dtype, seed=seed)
    token_order = _by_slot(slots) if order else None
    y = lora.shrink_with_plan(x, lora_a, slots, shrink, token_order=token_order)
    want_y = reference.lora_shrink(x, lora_a, slots)
    assert y.dtype == dtype and y.shape == want_y.shape
    torch.testing.assert_close(y.float().cpu(), want_y.float().cpu(), atol=ATOL[dtype], rtol=0)
    assert not y[slots < 0].any(), "rows without an adapter must shrink to zeros"
    want_out = out.clone()
    reference.lora_expand(want_out, want_y, lora_b, slots, bounds)
    base = out.clone()
    lora.expand_with_plan(out, want_y, lora_b, slots, bounds, expand, token_order)
    torch.testing.assert_close(out.float().cpu(), want_out.float().cpu(), atol=ATOL[dtype], rtol=0)
    assert torch.equal(out[slots < 0], base[slots < 0]), "rows without an adapter are left alone"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [1, 37])
@pytest.mark.parametrize(("rank", "bounds", "hidden"), CASES)
def test_lora_kernels_match_the_reference(dtype, t, rank, bounds, hidden) -> None:
    _check(t, rank, bounds, hidden, dtype)


# Each launch path forced: split hidden with slot classes, the same rows in one class over one
# pass, 16-column tiles (the straddling slices land in different tiles).
PLANS = [
    (LoraPlan(16, 16, 3, split_k=2), LoraPlan(16, 16, 3)),
    (LoraPlan(16, 16, 1, split_k=3), LoraPlan(32, 32, 2)),
    (LoraPlan(64, 32, 1, split_k=1), LoraPlan(64, 64, 1)),
]


@pytest.mark.parametrize(("shrink", "expand"), PLANS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("order", [False, True], ids=["step_order", "by_slot"])
def test_every_launch_path_matches_the_reference(shrink, expand, dtype, order) -> None:
    """Also with the rows visited grouped by slot (the order LoRAInputs gives the layers)."""
    _check(37, 12, (0, 40, 56, 72), 48, dtype, shrink, expand, seed=1, order=order)


def test_every_element_is_written_not_left_from_the_allocation(monkeypatch) -> None:
    """The shrink's output and its split workspace come from torch.empty: poison them (NaN) and
    the rows without an adapter, or of another program's slot class, must still be exact."""
    real_empty = torch.empty

    def poisoned(*args, **kwargs):
        tensor = real_empty(*args, **kwargs)
        return tensor.fill_(float("nan")) if tensor.is_floating_point() else tensor

    monkeypatch.setattr(torch, "empty", poisoned)
    for plan in (LoraPlan(16, 16, 3, split_k=2), LoraPlan(16, 16, 1, split_k=1)):
        _check(37, 12, (0, 40, 56, 72), 48, torch.float32, plan, None, seed=2)


def test_each_row_reads_its_own_slot() -> None:
    """All rows on one slot, then the same rows moved to another: the result follows the slot."""
    x, lora_a, lora_b, _, out = _operands(20, 8, (0, 24, 88), 40, torch.float32, seed=3)
    for slot in range(NUM_SLOTS):
        slots = torch.full((20,), slot, dtype=torch.int32, device=DEVICE)
        y = lora.lora_shrink(x, lora_a, slots)
        torch.testing.assert_close(y, x @ lora_a[slot].T, atol=1e-4, rtol=0)
        got, want = out.clone(), out.clone()
        lora.lora_expand(got, y, lora_b, slots, (0, 24, 88))
        want[:, :24] += y[:, :8] @ lora_b[slot, :24].T
        want[:, 24:] += y[:, 8:] @ lora_b[slot, 24:].T
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_no_adapter_anywhere() -> None:
    x, lora_a, lora_b, _, out = _operands(5, 8, (0, 24), 40, torch.float32)
    slots = torch.full((5,), -1, dtype=torch.int32, device=DEVICE)
    assert not lora.lora_shrink(x, lora_a, slots).any()
    base = out.clone()
    lora.lora_expand(out, torch.ones(5, 8, device=DEVICE), lora_b, slots, (0, 24))
    assert torch.equal(out, base)


def test_expand_adds_into_a_strided_view() -> None:
    """`out` as a column slice of a wider tensor and as a transposed (column-major) tensor."""
    x, lora_a, lora_b, slots, _ = _operands(9, 12, (0, 40, 56, 72), 48, torch.float32, seed=4)
    y = reference.lora_shrink(x, lora_a, slots)
    wide = torch.randn(9, 100, device=DEVICE)
    wide_before = wide.clone()
    column_major = torch.randn(72, 9, device=DEVICE).T
    for out in (wide[:, 10:82], column_major):
        want = out.clone()
        reference.lora_expand(want, y, lora_b, slots, (0, 40, 56, 72))
        lora.lora_expand(out, y, lora_b, slots, (0, 40, 56, 72))
        torch.testing.assert_close(out, want, atol=1e-4, rtol=0)
    assert torch.equal(wide[:, :10], wide_before[:, :10])
    assert torch.equal(wide[:, 82:], wide_before[:, 82:])


def test_bad_shapes_are_refused() -> None:
    x, lora_a, lora_b, slots, out = _operands(3, 8, (0, 24, 88), 40, torch.float32)
    y = reference.lora_shrink(x, lora_a, slots)
    with pytest.raises(ValueError, match="slice_bounds"):
        lora.lora_expand(out, y, lora_b, slots, (0, 24, 80))
    with pytest.raises(ValueError, match="slice_bounds"):
        lora.lora_expand(out, y, lora_b, slots, (0, 10, 20, 30, 88))
    with pytest.raises(ValueError, match="lora_shrink"):
        lora.lora_shrink(x[:, :32], lora_a, slots)


@pytest.mark.parametrize("per_row", [False, True], ids=["static", "per_token"])
def test_float8_input_with_its_scale(per_row: bool) -> None:
    """The shrink of a float8 input (what an FP8 base GEMM read, quantized by the norm before
    it) counts it as x * scale, a static scale or one per row, as its twin does."""
    x, lora_a, _, slots, _ = _operands(37, 12, (0, 40, 56, 72), 48, torch.float32, seed=5)
    scale = (x.abs().amax(dim=1, keepdim=True) if per_row else x.abs().max()) / 448.0
    x_fp8 = (x / scale).to(torch.float8_e4m3fn)
    for plan in (None, LoraPlan(16, 16, 3, split_k=2)):
        y = lora.shrink_with_plan(x_fp8, lora_a, slots, plan, scale)
        want = reference.lora_shrink(x_fp8, lora_a, slots, scale)
        assert y.dtype == lora_a.dtype
        torch.testing.assert_close(y, want, atol=1e-4, rtol=0)
    dequantized = reference.lora_shrink(x_fp8.float() * scale, lora_a, slots)
    torch.testing.assert_close(want, dequantized, atol=1e-5, rtol=0)


def _binder(kernel):
    """Triton's own argument specialisation of `kernel` (what keys its compiled variants),
    built from the kernel's Python function also under the interpreter."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    if not isinstance(kernel, JITFunction):
        kernel = JITFunction(kernel.fn, **kernel.kwargs)
    return create_function_from_signature(kernel.signature, kernel.params, BaseBackend)


# Token counts a run meets: decode batches (graphs and eager), prefill chunks of any length.
STEP_TOKENS = [*range(1, 70), 96, 100, 127, 128, 255, 256, 257, 300, 512, 777, 1024, 2048, 8192]


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float8_e4m3fn])
def test_no_new_variant_for_a_new_token_count(x_dtype) -> None:
    """Every step shape maps to one of the variants a 1-token and a max-token forward (the
    batch-1 decode graph and the memory profile, before the compile watch starts) compile."""
    shrink, expand = _binder(lora._lora_shrink_kernel), _binder(lora._lora_expand_kernel)
    cpu, hidden, bounds, rank = torch.device("cpu"), 4096, (0, 4096, 5120, 6144), 16
    lora_a = torch.zeros(8, 3 * rank, hidden, dtype=torch.float16)
    lora_b = torch.zeros(8, bounds[-1], rank, dtype=torch.float16)

    inputs = LoRAInputs(STEP_TOKENS[-1], cpu)  # the persistent slot and order buffers

    def variants(t: int) -> tuple[str, str]:
        x = torch.empty(t, hidden, dtype=x_dtype)
        scale = None if x_dtype == torch.float16 else torch.ones(t, 1)
        inputs.fill([0, -1], [t // 2, t - t // 2], t)
        slots, order = inputs.slots_for(t), inputs.order_for(t)
        y = torch.empty(t, 3 * rank, dtype=torch.float16)
        out = torch.empty(t, bounds[-1], dtype=torch.float16)
        plan = lora.shrink_plan(t, hidden, 3 * rank, 8, cpu)
        s = lora.shrink_launch(x, lora_a, slots, y, plan, scale, order)
        plan = lora.expand_plan(t, 6144, 8, cpu)
        e = lora.expand_launch(out, y, lora_b, slots, bounds, plan, order)
        return (str(shrink(*s.args, **s.constexprs)[1]), str(expand(*e.args, **e.constexprs)[1]))

    warmed = {variants(1), variants(STEP_TOKENS[-1])}
    for t in STEP_TOKENS:
        assert variants(t) in warmed, f"{t} tokens would compile a new LoRA kernel variant"


def test_plans_follow_the_shapes() -> None:
    cpu = torch.device("cpu")  # num_sms pretends 132 off the GPU
    decode = shrink_plan(1, 4096, 48, 8, cpu)
    assert decode.block_m == 16 and decode.split_k == 32 and decode.slot_groups == 1
    assert shrink_plan(8, 4096, 48, 8, cpu).slot_groups == 8  # one program per adapter class
    prefill = shrink_plan(4096, 4096, 48, 8, cpu)
    assert prefill.block_m == 64 and prefill.split_k < decode.split_k
    wide = shrink_plan(256, 4096, 192, 8, cpu)  # rank 64 x 3 slices: accumulator <= 4K values
    assert wide.block_m * 256 <= 4096 and wide.block_n == 32
    assert expand_plan(1, 6144, 8, cpu).slot_groups == 1  # one token: one adapter at most
    assert expand_plan(4, 6144, 8, cpu).slot_groups == 4
    assert expand_plan(4096, 28672, 8, cpu).slot_groups == 1


# ---------------------------------------------------------------------------------------------
# On a GPU: Llama-3.1-8B's fused projections, 8 adapters of rank 16, bf16

QKV = (0, 4096, 5120, 6144)
GATE_UP = (0, 14336, 28672)


def _reference_in_chunks(x, lora_a, lora_b, slots, out, bounds, rows=128):
    """The twins over row chunks (the reference gathers every row's weights: [T, n_out, rank])."""
    ys = []
    for i in range(0, x.shape[0], rows):
        ys.append(reference.lora_shrink(x[i : i + rows], lora_a, slots[i : i + rows]))
        reference.lora_expand(out[i : i + rows], ys[-1], lora_b, slots[i : i + rows], bounds)
    return torch.cat(ys)


@on_gpu
@pytest.mark.parametrize("t", [1, 256, 4096])
@pytest.mark.parametrize("bounds", [QKV, GATE_UP], ids=["qkv", "gate_up"])
def test_lora_llama8b_bf16(t: int, bounds: tuple[int, ...]) -> None:
    x, lora_a, lora_b, slots, out = _operands(t, 16, bounds, 4096, torch.bfloat16, num_slots=8)
    want_out = out.clone()
    want_y = _reference_in_chunks(x, lora_a, lora_b, slots, want_out, bounds)
    y = lora.lora_shrink(x, lora_a, slots)
    torch.testing.assert_close(y.float(), want_y.float(), atol=ATOL[torch.bfloat16], rtol=1e-2)
    lora.lora_expand(out, want_y, lora_b, slots, bounds)
    torch.testing.assert_close(out.float(), want_out.float(), atol=ATOL[torch.bfloat16], rtol=1e-2)


@on_gpu
def test_lora_in_a_cuda_graph() -> None:
    """Shrink and expand captured once; new slots, weights and inputs copied in place; each
    replay gives the reference's result."""
    t, bounds = 256, QKV
    x, lora_a, lora_b, slots, out = _operands(t, 16, bounds, 4096, torch.bfloat16, num_slots=8)
    base = out.clone()

    order = _by_slot(slots)  # the rows grouped by slot, updated in place as LoRAInputs does

    def step() -> torch.Tensor:
        out.copy_(base)
        y = lora.lora_shrink(x, lora_a, slots, None, order)
        lora.lora_expand(out, y, lora_b, slots, bounds, order)
        return y

    step()  # the warm-up a capture needs (compiles; makes the split-K counters)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for seed in range(1, 4):
        new = _operands(t, 16, bounds, 4096, torch.bfloat16, num_slots=8, seed=seed)
        for held, fresh in zip((x, lora_a, lora_b, slots, base), new):
            held.copy_(fresh)
        if seed == 3:
            slots[: t // 2] = -1
        order.copy_(_by_slot(slots))
        graph.replay()
        want_out = base.clone()
        want_y = _reference_in_chunks(x, lora_a, lora_b, slots, want_out, bounds)
        torch.testing.assert_close(y.float(), want_y.float(), atol=6e-2, rtol=1e-2)
        # The graph's expand read the graph's own y: compare the sum through it.
        torch.testing.assert_close(out.float(), want_out.float(), atol=1e-1, rtol=2e-2)
