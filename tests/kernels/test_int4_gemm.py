"""The W4A16 Triton kernels (kiln.kernels.triton.int4_gemm: tl.dot tiles, the 1-8 row
small-batch kernel, and the prefill path's dequantize_int4 + cuBLAS) against their twins in
reference, under TRITON_INTERPRET=1 without a GPU: over kiln's layout, and over the codes re-laid
for the sm_90 kernel (int4_mma_layout) when a layer keeps only those."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels.int4_mma_layout import repack
from kiln.kernels.triton import int4_gemm
from kiln.kernels.triton.int4_gemm import dequantize_int4, int4_linear

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
DTYPES = [torch.float32, torch.float16] + ([] if INTERPRET else [torch.bfloat16])
ATOL = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}


def _operands(n: int, k: int, groups: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen)
    scales = torch.rand(n, groups, generator=gen) * 0.02 + 0.005
    zeros = torch.randint(0, 16, (n, groups), generator=gen).float()
    return reference.pack_int4(codes), scales, zeros


def test_pack_and_unpack_are_inverse() -> None:
    codes = torch.randint(0, 16, (5, 64))
    packed = reference.pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (5, 8)
    assert torch.equal(reference.unpack_int4(packed), codes.to(torch.int32))
    # Code 8j + i of a row at bits 4i of word j.
    assert int(packed[0, 1]) & 0xF == int(codes[0, 8])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])
@pytest.mark.parametrize("groups", [1, 2, 4])  # K = 128: per channel, group 64, group 32
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_matches_the_reference(dtype, rows, groups, bias) -> None:
    n, k = 72, 128  # N not a multiple of the column tiles
    qweight, scales, zeros = _operands(n, k, groups)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    args = [t.to(DEVICE) if t is not None else None for t in (x, qweight, scales, zeros, b)]
    got = int4_linear(*args)
    want = reference.int4_linear(*args)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=ATOL[dtype], rtol=0)


def test_int4_linear_reads_each_groups_own_scale_and_zero() -> None:
    """A kernel that took group 0's scale or zero for every input would still be close on
    random data: perturb one group and see the output move as the reference's does."""
    qweight, scales, zeros = (t.to(DEVICE) for t in _operands(32, 128, 4))
    x = torch.randn(2, 128).to(DEVICE)
    before = int4_linear(x, qweight, scales, zeros)
    zeros[:, 3] += 1
    after = int4_linear(x, qweight, scales, zeros)
    torch.testing.assert_close(after, reference.int4_linear(x, qweight, scales, zeros))
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("rows", [2, 24])
def test_a_per_channel_k_that_is_no_multiple_of_the_tile(rows) -> None:
    qweight, scales, zeros = (t.to(DEVICE) for t in _operands(40, 72, 1))
    x = torch.randn(rows, 72, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch.testing.assert_close(
        int4_linear(x, qweight, scales, zeros),
        reference.int4_linear(x, qweight, scales, zeros),
        atol=1e-4,
        rtol=0,
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 40])  # the small-batch kernel, then the tiled one
@pytest.mark.parametrize("groups", [4, 8])  # groups of 32 and of 16 (GGUF's Q2_K / Q3_K)
def test_mins_instead_of_zero_points_match_the_reference(dtype, rows, groups) -> None:
    """GGUF's groups (kiln.checkpoint.gguf_int): code * scale + min, the min in weight units;
    read as a zero point it would give other weights."""
    n, k = 40, 128
    qweight, scales, _ = _operands(n, k, groups, seed=3)
    noise = torch.randn(n, groups, generator=torch.Generator().manual_seed(2))
    mins = -8.0 * scales + 0.001 * noise
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    args = [t.to(DEVICE) for t in (x, qweight, scales, mins)]
    got = int4_linear(*args, None, True)
    want = reference.int4_linear(*args, None, True)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=ATOL[dtype], rtol=0)
    as_zero_points = reference.int4_linear(*args, None, False)
    assert not torch.allclose(want.float(), as_zero_points.float(), atol=1.0)
    codes = reference.unpack_int4(qweight).float()
    size = k // groups
    w = codes * scales.repeat_interleave(size, 1) + mins.repeat_interleave(size, 1)
    assert torch.equal(reference.dequantize_int4(qweight, scales, mins, True), w)


# (N, K, group size; 0 per channel): groups of 32, 64 and 128 and per channel; N odd, not a
# multiple of 16 nor 128, and past one 128-row padding (int4_mma_layout.N_ALIGN).
_RELAID = [(72, 128, 32), (93, 256, 64), (200, 128, 0), (45, 256, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 9, 30, 70])  # small-batch kernel, then the tiled one
@pytest.mark.parametrize(("n", "k", "group_size"), _RELAID)
def test_the_relaid_codes_alone_give_what_kilns_layout_gives(dtype, rows, n, k, group_size):
    """int4_linear with only the re-laid copy (qweight None; MMA_LAYOUT): the same tiles and
    arithmetic as over kiln's layout, so the same values bit for bit, and the twin's."""
    groups = k // group_size if group_size else 1
    qweight, scales, zeros = _operands(n, k, groups, seed=rows + n)
    gen = torch.Generator().manual_seed(k + rows)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if rows % 2 else None
    relaid = repack(qweight)
    args = [t.to(DEVICE) if t is not None else None for t in (x, qweight, scales, zeros, bias)]
    x, qweight, scales, zeros, bias = args
    got = int4_linear(x, None, scales, zeros, bias, mma_weight=relaid.to(DEVICE))
    plain = int4_linear(x, qweight, scales, zeros, bias)
    want = reference.int4_linear(x, qweight, scales, zeros, bias)
    assert got.dtype == dtype and got.shape == (rows, n)
    assert torch.equal(got, plain)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=ATOL[dtype], rtol=0)
    twin = reference.int4_linear(x, None, scales, zeros, bias, mma_weight=relaid.to(DEVICE))
    assert torch.equal(twin, want)  # the twin unrepacks, exactly


@pytest.mark.parametrize("rows", [1, 6, 9, 40])
@pytest.mark.parametrize("group_size", [32, 64])
def test_the_relaid_codes_take_mins_instead_of_zero_points(rows, group_size) -> None:
    n, k = 40, 128
    qweight, scales, _ = _operands(n, k, k // group_size, seed=3)
    mins = -8.0 * scales + 0.001 * torch.randn(scales.shape, generator=torch.Generator())
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(4))
    x, qweight, scales, mins = (t.to(DEVICE) for t in (x, qweight, scales, mins))
    relaid = repack(qweight)
    got = int4_linear(x, None, scales, mins, None, True, mma_weight=relaid)
    want = reference.int4_linear(x, qweight, scales, mins, None, True)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert torch.equal(reference.int4_linear(x, None, scales, mins, None, True, relaid), want)


def test_codes_must_be_given_in_one_layout_with_the_scales_rows() -> None:
    qweight, scales, zeros = _operands(200, 128, 2)  # re-laid: 256 rows
    x = torch.randn(2, 128)
    with pytest.raises(ValueError, match="no codes"):
        int4_linear(x, None, scales, zeros)
    with pytest.raises(ValueError, match="no codes"):
        reference.int4_linear(x, None, scales, zeros)
    with pytest.raises(ValueError, match="expected"):  # re-laid codes of another N
        int4_linear(x, None, scales[:40], zeros[:40], mma_weight=repack(qweight))


# (N, K, group size; 0 per channel, zero_is_min): kiln's layout takes K = 72 per channel (no
# multiple of the tile) and groups of 16; the re-laid one K a multiple of 64, N padded to 128.
_DEQUANTIZE = [(72, 128, 32, False), (40, 72, 0, False), (40, 128, 16, True), (200, 128, 0, True),
               (93, 256, 64, False), (45, 256, 128, True)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n", "k", "group_size", "mins", "relaid"),
    [(*case, relaid) for case in _DEQUANTIZE for relaid in (False, True)
     if not (relaid and case[1] % 64)],  # re-laid codes exist for K a multiple of 64 only
)  # fmt: skip
def test_dequantize_int4_matches_its_twin_bit_for_bit(dtype, n, k, group_size, mins, relaid):
    """The kernel computes each weight in fp32 as the twin does and rounds it once. Scales
    with fp16's precision (as checkpoints hold them) make code * scale exact, so a GPU's fused
    multiply-add gives the same bits too."""
    groups = k // group_size if group_size else 1
    qweight, scales, zeros = _operands(n, k, groups, seed=n + k)
    scales = scales.half().float()
    if mins:
        zeros = -8.0 * scales + 0.001 * torch.randn(scales.shape, generator=torch.Generator())
    codes = (None, repack(qweight)) if relaid else (qweight, None)
    qw, scales, zeros, mma = (t.to(DEVICE) if t is not None else None
                              for t in (codes[0], scales, zeros, codes[1]))  # fmt: skip
    got = dequantize_int4(qw, scales, zeros, mins, mma, dtype)
    want = reference.dequantize_int4(qw, scales, zeros, mins, mma, dtype)
    assert got.dtype == dtype and got.shape == (n, k)
    assert torch.equal(got.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("relaid", [False, True])
@pytest.mark.parametrize("mins", [False, True])
def test_int4_linear_dequantizes_once_from_the_prefill_rows_on(monkeypatch, dtype, relaid, mins):
    """From DEQUANTIZE_ROWS rows on (lowered here), int4_linear is dequantize_int4 then one
    matmul, and still the reference's int4_linear; below it the tiled kernel runs."""
    n, k, rows = 93, 256, 40  # past int4_gemm_hopper.MAX_ROWS, which an sm_90 GPU would run
    qweight, scales, zeros = _operands(n, k, 4, seed=5)
    if mins:
        zeros = -8.0 * scales + 0.001 * torch.randn(scales.shape, generator=torch.Generator())
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    x, qweight, scales, zeros, bias = (t.to(DEVICE) for t in (x, qweight, scales, zeros, bias))
    codes = (None, repack(qweight)) if relaid else (qweight, None)
    calls = []

    def spy(*args):
        calls.append(args)
        return dequantize_int4(*args)

    monkeypatch.setattr(int4_gemm, "dequantize_int4", spy)
    monkeypatch.setattr(int4_gemm, "DEQUANTIZE_ROWS", rows + 1)
    tiled = int4_linear(x, codes[0], scales, zeros, bias, mins, codes[1])
    assert not calls
    monkeypatch.setattr(int4_gemm, "DEQUANTIZE_ROWS", rows)
    got = int4_linear(x, codes[0], scales, zeros, bias, mins, codes[1])
    assert len(calls) == 1
    want = reference.int4_linear(x, qweight, scales, zeros, bias, mins)
    assert got.dtype == dtype and got.shape == (rows, n)
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=ATOL[dtype], rtol=0)
    torch.testing.assert_close(got.float().cpu(), tiled.float().cpu(), atol=ATOL[dtype], rtol=0)
