"""The 8-bit Triton kernels against their twins under TRITON_INTERPRET=1 without a GPU:
W8A8 INT8 (int8_gemm.py), block-scaled FP8 (fp8_block_gemm.py) and W8A16 (w8a16_gemm.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels.triton import fp8_block_gemm, int8_gemm, w8a16_gemm

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
# (atol, rtol) of outputs whose fp32 sums differ only in order: one rounding of the output dtype.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-3), torch.bfloat16: (1e-1, 1e-2)}
# Hopper's float8 tensor cores keep fewer accumulator bits than fp32 (DeepSeek-V3's report, the
# reason for its per-block fp32 promotion): against the twin's exact fp32 sums, error up to this
# fraction of the output's largest magnitude. A wrong or dropped scale is off by far more.
FP8_DOT_ERROR = 2e-3


def _x(rows: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[0, 3] = 0.0  # a zero and an outlier column
    x[:, 5] *= 20
    if rows > 2:
        x[2] = 0.0  # an all-zero row: its scale floors, its codes stay 0
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_int8_equals_the_reference_exactly(dtype) -> None:
    x = _x(5, 200, dtype)
    # Exact ties of x / scale: half to even, not away from zero.
    x[1, :4] = torch.tensor([0.5, 1.5, -2.5, 127.0], dtype=dtype)
    got, got_scale = int8_gemm.quantize_int8(x)
    want, want_scale = reference.quantize_int8(x)
    assert got.dtype == torch.int8 and got_scale.shape == (5, 1)
    assert torch.equal(got_scale.cpu(), want_scale.cpu())
    assert torch.equal(got.cpu(), want.cpu())
    assert want[1, :3].tolist() == [0, 2, -2]  # scale 1: 0.5 -> 0, 1.5 -> 2, -2.5 -> -2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 33, 80])  # 80: cuBLAS on a GPU
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_the_reference(dtype, rows, bias) -> None:
    n, k = 72, 160  # neither a multiple of the tiles
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8).to(DEVICE)
    ws = (torch.rand(n, generator=gen) * 0.01 + 0.001).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE) if bias else None
    x = _x(rows, k, dtype)
    got = int8_gemm.int8_linear(x, w, ws, b)
    want = reference.int8_linear(x, w, ws, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    # Integer sums are exact in both: only the epilogue's fp32 rounding may differ.
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


def test_int8_matmul_applies_each_rows_and_columns_scale() -> None:
    """Exact integer products, then x_scale[m] * w_scale[n]: a kernel that swapped or dropped a
    scale, or accumulated in a narrower type, would not give these values."""
    x = torch.full((3, 64), 127, dtype=torch.int8)
    w = torch.full((5, 64), -127, dtype=torch.int8)
    xs = torch.tensor([[1.0], [2.0], [0.5]])
    ws = torch.tensor([1.0, 0.25, 2.0, 1.0, 1.0])
    got = int8_gemm.int8_matmul(*(t.to(DEVICE) for t in (x, xs, w, ws)), None, torch.float32)
    want = -127 * 127 * 64 * xs * ws
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fp8_groups_equals_the_reference_exactly(dtype) -> None:
    x = _x(4, 300, dtype)  # groups of 128, 128 and 44
    x[1, 130] = 1000.0  # one group's outlier changes that group's scale only
    got, got_scales = fp8_block_gemm.quantize_fp8_groups(x)
    want, want_scales = reference.quantize_fp8_groups(x)
    assert got_scales.shape == (4, 3)
    assert torch.equal(got_scales.cpu(), want_scales.cpu())
    assert torch.equal(got.view(torch.uint8).cpu(), want.view(torch.uint8).cpu())
    assert want_scales[1, 1] > 100 * want_scales[1, 0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 20])
@pytest.mark.parametrize("k", [256, 300])
def test_fp8_block_linear_matches_the_reference(dtype, rows, k) -> None:
    n = 200  # two 128-row blocks, the second partial
    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * 50).to(torch.float8_e4m3fn).to(DEVICE)
    groups = -(-k // 128)
    ws = (torch.rand(n, groups, generator=gen) * 0.01 + 0.001).to(DEVICE)
    b = torch.randn(n, generator=gen).to(dtype).to(DEVICE)
    x = _x(rows, k, dtype)
    got = fp8_block_gemm.fp8_block_linear(x, w, ws, b)
    want = reference.fp8_block_linear(x, w, ws, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    atol, rtol = TOL[dtype]
    if not INTERPRET:
        atol = max(atol, FP8_DOT_ERROR * want.float().abs().max().item())
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


def test_fp8_block_matmul_scales_each_block_by_its_own_scales() -> None:
    """Block g's partial sum times x_scales[:, g] * weight_scales[:, g]: a kernel that applied
    one block's scales to the whole row would give another result."""
    x = torch.ones(2, 256).to(torch.float8_e4m3fn)
    w = torch.ones(3, 256).to(torch.float8_e4m3fn)
    xs = torch.tensor([[1.0, 2.0], [3.0, 0.5]])
    ws = torch.tensor([[1.0, 10.0], [2.0, 0.0], [0.5, 1.0]])
    got = fp8_block_gemm.fp8_block_matmul(*(t.to(DEVICE) for t in (x, xs, w, ws)), None,
                                          torch.float32)  # fmt: skip
    want = 128 * (xs[:, :1] * ws[:, 0] + xs[:, 1:] * ws[:, 1])
    assert torch.equal(got.cpu(), want)
    assert torch.equal(reference.fp8_block_matmul(x, xs, w, ws, None, torch.float32), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("groups", [1, 2, 4])  # K = 128: per channel, group 64, group 32
@pytest.mark.parametrize("rows", [1, 3, 9, 40])  # 1-8: the small-batch kernel
def test_w8a16_linear_matches_the_reference(dtype, weight_dtype, groups, rows) -> None:
    n, k = 72, 128
    gen = torch.Generator().manual_seed(0)
    if weight_dtype == torch.int8:
        w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    else:
        w = (torch.randn(n, k, generator=gen) * 50).to(weight_dtype)
    scales = torch.rand(n, groups, generator=gen) * 0.002 + 0.0005
    b = torch.randn(n, generator=gen).to(dtype)
    x = _x(rows, k, dtype).cpu()
    args = [t.to(DEVICE) for t in (x, w, scales, b)]
    got = w8a16_gemm.w8a16_linear(*args)
    want = reference.w8a16_linear(*args)
    assert got.dtype == dtype and got.shape == (rows, n)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)


def test_w8a16_linear_reads_each_groups_own_scale() -> None:
    w = torch.ones(2, 128, dtype=torch.int8)
    scales = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    x = torch.ones(1, 128)
    got = w8a16_gemm.w8a16_linear(*(t.to(DEVICE) for t in (x, w, scales)))
    assert got.cpu().tolist() == [[64.0, 128.0]]


def test_the_scale_epilogue_takes_cublas_int32_sums() -> None:
    """From 64 rows on a GPU, int8_matmul's sums come from torch._int_mm as int32 and go
    through fp8_gemm's scale epilogue: the epilogue on int32 sums equals int8_matmul's
    arithmetic (the GEMM itself is cuBLAS's; on a GPU the test above runs it at 80 rows)."""
    from kiln.kernels.triton.fp8_gemm import _scale_epilogue

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-127, 128, (5, 64), generator=gen, dtype=torch.int8)
    w = torch.randint(-127, 128, (24, 64), generator=gen, dtype=torch.int8)
    xs, ws = torch.rand(5, 1, generator=gen), torch.rand(24, generator=gen)
    b = torch.randn(24, generator=gen)
    acc = (x.double() @ w.double().t()).to(torch.int32)
    got = _scale_epilogue(*(t.to(DEVICE) for t in (acc, xs, ws, b)), torch.float32)
    want = reference.int8_matmul(x, xs, w, ws, b, torch.float32)
    if INTERPRET:
        assert torch.equal(got.cpu(), want)
    else:  # the GPU fuses the last multiply and the bias add (one rounding, not two)
        ulp = torch.finfo(torch.float32).eps * want.abs().max().item()
        torch.testing.assert_close(got.cpu(), want, atol=ulp, rtol=0)
