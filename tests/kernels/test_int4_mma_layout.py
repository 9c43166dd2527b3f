"""The sm_90 W4A16 layout (kiln.kernels.int4_mma_layout) and the Gluon kernel's index math over it
(kiln.kernels.triton.int4_gemm_hopper), on the CPU: repack is an exact permutation, and a
PyTorch transcription of the kernel's program (the same loads, reshapes, splits and joins, which
mean the same in torch as in Gluon; the MMAs as fp32 matmuls) matches reference.int4_linear.
The compiled kernel's registers are checked in test_int4_gemm_hopper_sm90_compile.py, its values
on a GPU in test_int4_gemm_hopper.py."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import int4_mma_layout as layout
from kiln.kernels import reference
from tests.kernels.test_int4_gemm import _operands


def test_repack_is_a_permutation_that_unrepack_undoes() -> None:
    qweight, _, _ = _operands(200, 192, 1)  # rows padded to 256
    repacked = layout.repack(qweight)
    assert repacked.shape == (256 // 16, 2 * 192) and repacked.dtype == torch.int32
    assert torch.equal(layout.unrepack(repacked, 200), qweight)
    codes = reference.unpack_int4(qweight)
    moved = reference.unpack_int4(repacked.reshape(-1, 1)).flatten()
    assert torch.equal(torch.bincount(moved, minlength=16)[1:],
                       torch.bincount(codes.flatten(), minlength=16)[1:])  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 64"):
        layout.repack(reference.pack_int4(torch.zeros(16, 96, dtype=torch.int32)))


def test_a_word_holds_one_lanes_a_fragment() -> None:
    """Word [tile, step, g, t, s], nibble n8 + 2 * k8 + 4 * k1: row 16 * tile + 8 * n8 + g,
    input 64 * step + 32 * (s // 2) + 8t + 4 * (s % 2) + 2 * k8 + k1 (the docstring's map)."""
    n, k = 48, 128
    codes = torch.randint(0, 16, (n, k), generator=torch.Generator().manual_seed(5))
    words = layout.repack(reference.pack_int4(codes)).reshape(-1, k // 64, 8, 4, 4)
    for tile, step, g, t, s in ((0, 0, 0, 0, 0), (1, 1, 7, 3, 3), (2, 0, 5, 1, 2), (0, 1, 2, 2, 1)):
        word = int(words[tile, step, g, t, s])
        for n8 in range(2):
            for k8 in range(2):
                for k1 in range(2):
                    nibble = (word >> 4 * (n8 + 2 * k8 + 4 * k1)) & 0xF
                    row = 16 * tile + 8 * n8 + g
                    col = 64 * step + 32 * (s // 2) + 8 * t + 4 * (s % 2) + 2 * k8 + k1
                    assert nibble == codes[row, col]


# ---- the kernel's program, transcribed -----------------------------------------------------

_MAGIC = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}


def _halves(pairs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    low = (pairs & 0xFFFF).to(torch.int16).view(dtype)
    high = (pairs >> 16).to(torch.int16).view(dtype)
    return torch.stack([low, high], -1)  # gl.join


def _a_operand(word: torch.Tensor, magic: int, dtype: torch.dtype) -> torch.Tensor:
    def pairs(shift: int) -> torch.Tensor:
        return ((word >> shift) & 0x000F000F) | magic

    lo_rows = torch.stack([pairs(0), pairs(8)], -1)
    hi_rows = torch.stack([pairs(4), pairs(12)], -1)
    a = _halves(torch.stack([lo_rows, hi_rows], -1), dtype)
    a = a.permute(0, 4, 1, 3, 2, 5)
    return a.reshape(a.shape[0] * 16, 16)


def _words(words: torch.Tensor, magic: int, dtype: torch.dtype) -> list[torch.Tensor]:
    words = words.reshape(words.shape[0], 8, 4, 2, 2)
    even, odd = words.unbind(-1)  # gl.split
    w0, w2 = even.unbind(-1)
    w1, w3 = odd.unbind(-1)
    return [_a_operand(w, magic, dtype) for w in (w0, w1, w2, w3)]


def _b_operands(x: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    rows = x.shape[3]
    x = _halves(x, dtype).reshape(2, 4, 2, 2, rows, 2).permute(3, 1, 5, 4, 0, 2)
    even, odd = x.unbind(-1)
    b0, b2 = even.unbind(-1)
    b1, b3 = odd.unbind(-1)
    return [b.reshape(16, rows) for b in (b0, b1, b2, b3)]


def emulate(x, repacked, scales, zeros, bias=None, zero_is_min=False):
    """int4_gemm_hopper._int4_mma_kernel's arithmetic for one row tile, every column tile at
    once (a tile's warps are consecutive 16-row tiles of the repacked words)."""
    from kiln.kernels.triton.int4_gemm_hopper import group_shift, rows_per_program

    m, k = x.shape
    n, groups = scales.shape
    shift = group_shift(k, k // groups)
    magic, offset = _MAGIC[x.dtype]
    rows = rows_per_program(m)
    padded = torch.zeros(rows, k, dtype=x.dtype)
    padded[:m] = x
    x_pairs = padded.view(torch.int32)  # [rows, K / 2]
    tiles = repacked.shape[0]
    s = torch.zeros(tiles * 16, groups)
    z = torch.zeros(tiles * 16, groups)
    s[:n], z[:n] = scales, zeros  # the kernel's masked loads
    total = torch.zeros(tiles * 16, rows)
    ones = torch.ones(tiles * 16, 16)

    def apply(dot, sums, group):
        scale, zero = s[:, group, None], z[:, group, None]
        if zero_is_min:
            return scale * (dot - offset * sums) + zero * sums
        return scale * (dot - (offset + zero) * sums)

    for step in range(k // 64):
        words = repacked[:, step * 128 : (step + 1) * 128].reshape(tiles, 8, 4, 4)
        # Pair offsets row * K / 2 + 16h + 4t + p of the step: [h, t, p, row].
        xs = x_pairs[:, step * 32 : (step + 1) * 32].reshape(rows, 2, 4, 4).permute(1, 2, 3, 0)
        a = [t.float() for t in _words(words, magic, x.dtype)]
        b = [t.float() for t in _b_operands(xs, x.dtype)]
        if k // groups == 32:
            total += apply(a[0] @ b[0] + a[1] @ b[1], ones @ b[0] + ones @ b[1], 2 * step)
            total += apply(a[2] @ b[2] + a[3] @ b[3], ones @ b[2] + ones @ b[3], 2 * step + 1)
        else:
            dot = sum(a[i] @ b[i] for i in range(4))
            sums = sum(ones @ b[i] for i in range(4))
            total += apply(dot, sums, step >> shift)
    y = total[:n, :m].t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 5, 8, 13])
@pytest.mark.parametrize("group_size", [32, 64, 128, 0])  # 0: per channel
def test_the_kernels_program_matches_the_reference(dtype, rows, group_size) -> None:
    n, k = 72, 256  # N not a multiple of a tile
    groups = k // group_size if group_size else 1
    qweight, scales, zeros = _operands(n, k, groups)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = emulate(x, layout.repack(qweight), scales, zeros, bias)
    want = reference.int4_linear(x, qweight, scales, zeros, bias)
    exact = reference.dequantize_int4(qweight, scales, zeros)
    exact = x.float() @ exact.t() + bias.float()
    # At least as close to the exact product as the twin (which rounds the weights to dtype).
    assert (got.float() - exact).abs().max() <= (want.float() - exact).abs().max() * 1.5 + 1e-3
    torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.02)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernels_program_takes_mins_instead_of_zero_points(dtype) -> None:
    n, k, groups = 40, 128, 4
    qweight, scales, _ = _operands(n, k, groups, seed=3)
    mins = -8.0 * scales + 0.001 * torch.randn(
        n, groups, generator=torch.Generator().manual_seed(2)
    )
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(4)).to(dtype)
    got = emulate(x, layout.repack(qweight), scales, mins, None, True)
    want = reference.int4_linear(x, qweight, scales, mins, None, True)
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
    assert not torch.allclose(got.float(), emulate(x, layout.repack(qweight), scales, mins).float())
