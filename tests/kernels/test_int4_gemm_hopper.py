"""The sm_90 Gluon W4A16 kernel (kiln.kernels.triton.int4_gemm_hopper) against its twin,
reference.int4_linear over the original codes, on an H100 / H200: Llama-3.1-8B's projections,
1 / 2 / 5 / 8 / 32 rows, bf16 and fp16, groups of 128, 32 and per channel, zero points and GGUF's
mins, an odd N, split-K and none. Skipped without an sm_90 GPU (Gluon has no interpreter: the
CPU checks its program in test_int4_mma_layout.py, its compiled code in
test_int4_gemm_hopper_sm90_compile.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU (H100 / H200)",
)

pytest.importorskip("triton.experimental.gluon", reason="triton without Gluon")

from kiln.kernels import reference  # noqa: E402
from kiln.kernels.int4_mma_layout import repack  # noqa: E402

# Llama-3.1-8B: qkv, o, gate_up, down.
_LLAMA = ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336))


def _operands(n: int, k: int, group_size: int, seed: int = 0, mins: bool = False):
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.005
    if mins:
        zeros = -8.0 * scales + 0.001 * torch.randn(n, groups, generator=gen)
    else:
        zeros = torch.randint(0, 16, (n, groups), generator=gen).float()
    qweight = reference.pack_int4(codes)
    return [t.cuda() for t in (qweight, scales, zeros)]


def _check(m, n, k, group_size, dtype, mins=False, bias=False, seed=0):
    from kiln.kernels.triton import int4_gemm_hopper as hopper

    qweight, scales, zeros = _operands(n, k, group_size, seed, mins)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(m, k, generator=gen).to(dtype).cuda()
    b = torch.randn(n, generator=gen).to(dtype).cuda() if bias else None
    got = hopper.int4_linear_mma(x, repack(qweight), scales, zeros, b, mins)
    want = reference.int4_linear(x, qweight, scales, zeros, b, mins)
    exact = x.double() @ reference.dequantize_int4(qweight, scales, zeros, mins).double().t()
    if bias:
        exact += b.double()
    assert got.dtype == dtype and got.shape == (m, n)
    # At least as exact as the twin (which rounds the weights to x's dtype), up to the output's
    # own rounding.
    ulp = exact.abs().max().item() * (2**-7 if dtype == torch.bfloat16 else 2**-10)
    got_err = (got.double() - exact).abs().max().item()
    want_err = (want.double() - exact).abs().max().item()
    assert got_err <= want_err + ulp, (got_err, want_err)
    torch.testing.assert_close(got.float(), want.float(), atol=2 * ulp + want_err, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 32])
@pytest.mark.parametrize(("n", "k"), _LLAMA)
def test_llama_projections_group_128(dtype, m, n, k) -> None:
    _check(m, n, k, 128, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 8])
@pytest.mark.parametrize("group_size", [32, 64, 4096])  # 4096: per channel
def test_group_sizes(dtype, m, group_size) -> None:
    _check(m, 4096, 4096, group_size, dtype, bias=True, seed=group_size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 5, 8])
@pytest.mark.parametrize("group_size", [32, 128])
def test_mins_instead_of_zero_points(dtype, m, group_size) -> None:
    _check(m, 4096, 4096, group_size, dtype, mins=True, seed=7)


@pytest.mark.parametrize("m", [1, 3, 17])
def test_an_odd_n_and_a_short_k(m) -> None:
    _check(m, 4097 - 64, 384, 64, torch.bfloat16, bias=True, seed=3)  # 3 iterations, odd N
    _check(m, 200, 128, 64, torch.float16, seed=4)  # one loop iteration: no split


def test_split_k_and_none_agree() -> None:
    """The same call split over 16 programs a tile and over one (many column tiles leave no
    room to split): the in-kernel reduction changes nothing but the order of fp32 sums."""
    from kiln.kernels.triton import int4_gemm_hopper as hopper

    qweight, scales, zeros = _operands(4096, 4096, 128, seed=9)
    x = torch.randn(1, 4096, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).cuda()
    packed = repack(qweight)
    split = hopper.int4_linear_mma(x, packed, scales, zeros)
    _, _, meta = hopper.launch_config(1, 4096, 4096, 128, torch.bfloat16, x.device)
    assert meta["SPLIT_K"] > 1
    saved = hopper.MAX_SPLIT
    hopper.MAX_SPLIT = 1
    try:
        whole = hopper.int4_linear_mma(x, packed, scales, zeros)
    finally:
        hopper.MAX_SPLIT = saved
    torch.testing.assert_close(split.float(), whole.float(), atol=2e-2, rtol=1e-2)
    # Run to run, the same bits (the last program sums the partials in split order).
    assert torch.equal(split, hopper.int4_linear_mma(x, packed, scales, zeros))


def test_int4_linear_takes_the_relaid_codes_only_when_selected() -> None:
    from kiln.kernels.triton import int4_gemm, int4_gemm_hopper

    qweight, scales, zeros = _operands(512, 1024, 128)
    x = torch.randn(2, 1024).to(torch.bfloat16).cuda()
    want = reference.int4_linear(x, qweight, scales, zeros)
    wrong = torch.zeros_like(repack(qweight))  # zero codes: only this kernel would read them
    saved = set(int4_gemm_hopper.SELECTED)
    try:
        int4_gemm_hopper.SELECTED.clear()
        off = int4_gemm.int4_linear(x, qweight, scales, zeros, mma_weight=wrong)
        int4_gemm_hopper.SELECTED.add(torch.bfloat16)
        on = int4_gemm.int4_linear(x, qweight, scales, zeros, mma_weight=wrong)
    finally:
        int4_gemm_hopper.SELECTED.clear()
        int4_gemm_hopper.SELECTED.update(saved)
    torch.testing.assert_close(off.float(), want.float(), atol=0.1, rtol=0.02)
    assert not torch.allclose(on.float(), want.float(), atol=0.1)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_int4_method_relays_the_codes_when_selected(act_order) -> None:
    """Int4LinearMethod re-lays the codes after loading (act-order's reordered ones) where the
    kernel is selected and keeps only that copy, and the layer then computes what the twin does
    over the codes it puts back."""
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.triton import int4_gemm_hopper
    from kiln.layers.linear import Linear
    from kiln.layers.quantization.int4 import Int4LinearMethod

    k, n = 1024, 384
    qweight, scales, zeros = _operands(n, k, 128, seed=11)
    g_idx = torch.arange(k) // 128
    if act_order:
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(5))]
    saved = set(int4_gemm_hopper.SELECTED)
    try:
        int4_gemm_hopper.SELECTED.add(torch.bfloat16)
        with torch.device("cuda"):
            layer = Linear(k, n, method=Int4LinearMethod(128))
        for param, tensor in zip(
            (layer.weight, layer.weight_scales, layer.weight_zeros, layer.weight_g_idx),
            (qweight, scales, zeros, g_idx.int()),
        ):
            layer.weight_loader(param, None, tensor.cuda())  # fmt: skip
        layer.method.process_weights_after_loading(layer)
        # One copy of the codes: the re-laid one (act-order's reordered codes), the original gone.
        assert layer.weight_mma is not None and layer.weight.numel() == 0
        codes = reference.unpack_int4(qweight)
        if act_order:
            codes = codes[:, layer.input_order]
        assert torch.equal(layer.weight_mma, repack(reference.pack_int4(codes)))
        assert torch.equal(layer.method.engine_tensor(layer, "weight", layer.weight),
                           reference.pack_int4(codes))  # fmt: skip
        x = torch.randn(3, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16).cuda()
        got = layer.method.apply(layer, triton_ops, x)
    finally:
        int4_gemm_hopper.SELECTED.clear()
        int4_gemm_hopper.SELECTED.update(saved)
    want = layer.method.apply(layer, reference, x)  # the twin unrepacks the codes
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.02)
