"""INT4 codes re-laid for the sm_90 W4A16 kernel (kiln.kernels.triton.int4_gemm_hopper): each
thread's one 16-byte load is its four tensor-core A fragments, in register order, so the codes
go from the load to the MMA with no shared memory and no shuffle. A pure permutation of kiln's
layout ([N, K / 8] int32, code 8j + i of a row at bits 4i of word j: reference.unpack_int4),
made once after loading (kiln.layers.quantization.int4) and undone exactly by `unrepack`. The
layer then keeps only this copy: int4_gemm's Triton kernels read it too (their MMA_LAYOUT, the
same map below as index math), and an engine is written from unrepack's codes.

The kernel computes y^T = W @ x^T with the weights as operand A of mma.sync m16n8k16: output
columns are the MMA's M dimension (16 a warp), rows of x its N (8), so one row wastes nothing on
the weight side. Lane (g, t) = (lane // 4, lane % 4) of a warp holds, for one 16 x 16 A tile,
rows g and g + 8 at MMA columns 2t, 2t + 1, 2t + 8, 2t + 9: eight codes, one int32 word. Its
nibble i = n8 + 2 * k8 + 4 * k1 holds row g + 8 * n8 at MMA column 8 * k8 + 2t + k1, so
`(word >> 4 * (n8 + 2 * k8)) & 0x000F000F` puts the two codes of one A register (k1 = 0 low,
k1 = 1 high) in its two 16-bit halves, where OR-ing an exponent makes them floats.

A loop step covers K_STEP = 64 inputs as four MMA steps s = 2h + s'. MMA column 8 * k8 + 2t + k1
of step s is input 32h + 8t + 4s' + 2 * k8 + k1 of the loop step: lane t's inputs of the whole
step are 32h + 8t .. + 7 for h = 0, 1, two 16-byte loads of x, and each half h (steps 2h, 2h + 1)
stays within 32 inputs, so groups of 32 never straddle an MMA step.

Words lie as [N_pad / 16, K / 64, 8 (g), 4 (t), 4 (s)]: a warp's 16 rows of one loop step are 512
contiguous bytes, lane 4g + t's 16 at offset 16 * (4g + t); the rows are padded with zero codes
to N_pad, a multiple of N_ALIGN, so no weight load needs a mask."""

from __future__ import annotations

import torch

from kiln.kernels.reference import pack_int4, unpack_int4

K_STEP = 64  # inputs a loop step of the kernel reads: four k16 MMA steps
N_TILE = 16  # output columns of a warp's MMA tile
N_ALIGN = 128  # rows padded to a multiple of this: tiles of up to 8 warps need no masks


def repacked_rows(n: int) -> int:
    """N_pad: the repacked layout's rows (zero codes past n)."""
    return -(-n // N_ALIGN) * N_ALIGN


def repack(qweight: torch.Tensor) -> torch.Tensor:  # [N_pad / 16, 2 * K] int32
    """kiln's [N, K / 8] int32 codes in the kernel's order (the module's docstring)."""
    n, k = qweight.shape[0], qweight.shape[1] * 8
    if k % K_STEP:
        raise ValueError(f"the sm_90 INT4 layout needs K a multiple of {K_STEP}, got {k}")
    codes = unpack_int4(qweight)
    codes = torch.cat([codes, codes.new_zeros(repacked_rows(n) - n, k)])
    # [nt, n8, g, it, h, t, s', k8, k1]: row nt * 16 + 8 * n8 + g, input
    # it * 64 + 32h + 8t + 4s' + 2 * k8 + k1.
    codes = codes.reshape(-1, 2, 8, k // K_STEP, 2, 4, 2, 2, 2)
    # -> [nt, it, g, t, h, s', k1, k8, n8]: a word's nibble i = n8 + 2 * k8 + 4 * k1.
    codes = codes.permute(0, 3, 2, 5, 4, 6, 8, 7, 1)
    return pack_int4(codes.reshape(-1, 8)).reshape(-1, 2 * k)


def unrepack(repacked: torch.Tensor, n: int) -> torch.Tensor:  # [n, K / 8] int32
    """repack's inverse: the first n rows in kiln's layout."""
    k = repacked.shape[1] // 2
    codes = unpack_int4(repacked.reshape(-1, 1)).reshape(-1, k // K_STEP, 8, 4, 2, 2, 2, 2, 2)
    codes = codes.permute(0, 8, 2, 1, 4, 3, 5, 7, 6)  # back to [nt, n8, g, it, h, t, s', k8, k1]
    return pack_int4(codes.reshape(-1, k)[:n])
