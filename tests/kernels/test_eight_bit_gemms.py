"""The 8-bit Triton kernels against their twins under TRITON_INTERPRET=1 without a GPU:
W8A8 INT8 (int8_gemm.py, and the norm and activation-mul passes that quantize to int8),
block-scaled FP8 (fp8_block_gemm.py) and W8A16 (w8a16_gemm.py)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton import fp8_block_gemm, int8_gemm, silu_mul, w8a16_gemm

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


@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_quant_int8_rounds_exactly_as_the_reference(residual) -> None:
    """x of ones with eps 0 normalises to exactly 1, so the row entering the quantization is the
    norm weight itself (a norm's fp32 sum may differ by an ulp from torch's): the weight's exact
    ties of w / scale must round half to even, as quantize_int8's IEEE quotient does."""
    w = _x(1, 200, torch.float32)[0]
    w[:4] = torch.tensor([0.5, 1.5, -2.5, 127.0])  # absmax 127 * 20-ish: scale from column 5
    w[5] = 127.0 * 4  # scale 4 exactly: 0.5 / 4 ... and the ties below
    w[6:9] = torch.tensor([2.0, 6.0, -10.0])  # 0.5, 1.5, -2.5 in code units
    x = torch.ones(3, 200, device=DEVICE)
    r = torch.zeros_like(x) if residual else None
    got, got_scale, got_sum = triton_ops.add_rms_norm_quant_int8(x, r, w, 0.0)
    want, want_scale, want_sum = reference.add_rms_norm_quant_int8(x, r, w, 0.0)
    assert got.dtype == torch.int8 and got_scale.shape == (3, 1)
    assert want_scale[0].item() == 4.0 and want[0, 6:9].tolist() == [0, 2, -2]
    assert torch.equal(got_scale.cpu(), want_scale.cpu())
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got_sum.cpu(), want_sum.cpu())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_quant_int8_matches_the_reference(dtype, residual) -> None:
    """Random rows: the residual sum bit for bit, each row's scale to its norm's last ulp, and a
    code at most one step off (where the norm's sum order moved a value across a midpoint)."""
    x = _x(5, 200, dtype)
    r = _x(5, 200, dtype, seed=2) if residual else None
    gen = torch.Generator().manual_seed(3)
    w = (torch.rand(200, generator=gen) + 0.5).to(dtype).to(DEVICE)
    got, got_scale, got_sum = triton_ops.add_rms_norm_quant_int8(x, r, w, 1e-5)
    want, want_scale, want_sum = reference.add_rms_norm_quant_int8(x, r, w, 1e-5)
    assert torch.equal(got_sum.cpu(), want_sum.cpu())
    torch.testing.assert_close(got_scale.cpu(), want_scale.cpu(), rtol=1e-5, atol=0)
    diff = (got.int() - want.int()).abs().cpu()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.97
    assert want.abs().max() == 127  # each row's absmax on the top code
    assert not want[2].any()  # the zero row (x and r both 0 there): its codes stay 0


def _two_pass(monkeypatch) -> None:
    """Rows wider than one register pass: the quantizing activation kernels' two-pass loop."""
    monkeypatch.setattr(silu_mul, "_QUANT_ONE_PASS_MAX", 64)
    monkeypatch.setattr(silu_mul, "_QUANT_LOOP_BLOCK", 32)


@pytest.mark.parametrize("one_pass", [True, False])
def test_silu_and_mul_quant_int8_rounds_exactly_as_the_reference(one_pass, monkeypatch) -> None:
    """silu(32) is 32 exactly in fp32 and 32 * (v / 32) is v: the product entering the
    quantization is the chosen row, whose exact ties must round half to even."""
    if not one_pass:
        _two_pass(monkeypatch)
    row = _x(1, 100, torch.float32)[0].cpu()
    row[5] = 127.0 * 4  # scale 4 exactly
    row[6:9] = torch.tensor([2.0, 6.0, -10.0])  # 0.5, 1.5, -2.5 in code units
    x = torch.cat([torch.full_like(row, 32.0), row / 32]).view(1, -1).repeat(2, 1).to(DEVICE)
    got, got_scale = silu_mul.silu_and_mul_quant_int8(x)
    want, want_scale = reference.silu_and_mul_quant_int8(x.cpu())
    assert want_scale[0].item() == 4.0 and want[0, 6:9].tolist() == [0, 2, -2]
    assert torch.equal(got_scale.cpu(), want_scale)
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("one_pass", [True, False])
def test_act_and_mul_quant_int8_matches_the_reference(dtype, gelu, one_pass, monkeypatch) -> None:
    """Random rows through SiLU and GeGLU: each row's scale to its activation's last ulp and a
    code at most one step off (the GPU's silu is approximate; the interpreter's is exact)."""
    if not one_pass:
        _two_pass(monkeypatch)
    x = _x(4, 2 * 100, dtype)
    kernel = silu_mul.gelu_tanh_and_mul_quant_int8 if gelu else silu_mul.silu_and_mul_quant_int8
    twin = reference.gelu_tanh_and_mul_quant_int8 if gelu else reference.silu_and_mul_quant_int8
    got, got_scale = kernel(x)
    want, want_scale = twin(x)
    assert got.dtype == torch.int8 and got.shape == (4, 100) and got_scale.shape == (4, 1)
    torch.testing.assert_close(got_scale.cpu(), want_scale.cpu(), rtol=2e-3, atol=0)
    diff = (got.int() - want.int()).abs().cpu()
    assert diff.max() <= 1 and (diff == 0).float().mean() > 0.97
    if INTERPRET:  # the same fp32 arithmetic: bit for bit
        assert torch.equal(got_scale.cpu(), want_scale.cpu()) and torch.equal(got, want)
    assert not want[2].any()  # the zero row: its scale floors, its codes stay 0


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
@pytest.mark.parametrize("groups", [1, 2, 4, 8])  # K = 128: per channel, groups of 64, 32, 16
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("groups", [4, 8])  # groups of 32 and 16 (GGUF's Q5 / Q6_K blocks)
@pytest.mark.parametrize("rows", [1, 9])
def test_w8a16_linear_with_mins_matches_the_reference(dtype, groups, rows) -> None:
    """code * scale + min per group (kiln.checkpoint.gguf_int's Q5_1 / Q5_K / mixed layers):
    the twin's weights are GGUF's arithmetic, and the kernel adds each group's own min."""
    n, k = 40, 128
    gen = torch.Generator().manual_seed(2)
    w = torch.randint(0, 32, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, groups, generator=gen) * 0.002 + 0.0005
    mins = -16 * scales + 0.001 * torch.randn(n, groups, generator=gen)
    x = _x(rows, k, dtype).cpu()
    args = [t.to(DEVICE) for t in (x, w, scales)]
    got = w8a16_gemm.w8a16_linear(*args, None, mins.to(DEVICE))
    want = reference.w8a16_linear(*args, None, mins.to(DEVICE))
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=atol, rtol=rtol)
    without = reference.w8a16_linear(*args)
    assert not torch.allclose(want.float().cpu(), without.float().cpu(), atol=10 * atol)
    expanded = (w.float() * scales.repeat_interleave(k // groups, 1)
                + mins.repeat_interleave(k // groups, 1))  # fmt: skip
    assert torch.equal(reference.dequantize_w8(w, scales, mins), expanded)


def test_w8a16_linear_reads_each_groups_own_min() -> None:
    w = torch.zeros(2, 128, dtype=torch.int8)
    scales = torch.ones(2, 8)
    mins = torch.zeros(2, 8)
    mins[0, 7], mins[1, 0] = 1.0, -2.0
    x = torch.ones(1, 128)
    got = w8a16_gemm.w8a16_linear(*(t.to(DEVICE) for t in (x, w, scales)), None, mins.to(DEVICE))
    assert got.cpu().tolist() == [[16.0, -32.0]]


@pytest.mark.parametrize("rows", [2, 24])  # the small-batch kernel and the GEMM
def test_w8a16_linear_takes_groups_of_16(rows) -> None:
    """An FP4 checkpoint's exact int8 conversion (kiln.checkpoint.fp4_formats): codes in
    [-12, 12], a scale per 16 inputs (K tiles of 16), each group's own."""
    n, k = 40, 128
    gen = torch.Generator().manual_seed(1)
    w = torch.randint(-12, 13, (n, k), generator=gen, dtype=torch.int8)
    scales = torch.rand(n, k // 16, generator=gen) * 0.01 + 0.001
    x = _x(rows, k, torch.float32).cpu()
    args = [t.to(DEVICE) for t in (x, w, scales)]
    got = w8a16_gemm.w8a16_linear(*args)
    torch.testing.assert_close(got.cpu(), reference.w8a16_linear(*args).cpu())


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
