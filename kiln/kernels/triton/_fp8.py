"""float8 e4m3 -> fp16 for the V operand of the attention kernels (GPU only).

Measured on an H200 (`benchmarks/results/fp8_run6/`, 384 x 1.5k decode): with float8 keys and
fp16 values the decode kernel streams at 4.3 TB/s, with float8 values at 2.4 TB/s whatever the
tile. Written as `v.to(tl.float16)`, Triton keeps V in float8 through shared memory and widens it
after loading the tensor-core operand, and an 8-bit operand that P @ V needs transposed takes a
slow path. An opaque conversion right after the global load (one `cvt.rn.f16x2.e4m3x2` per two
values) makes V reach shared memory as fp16, which the 16-bit transposing load handles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def fp8e4m3_to_fp16(x):
    # Four float8 values arrive packed in one 32-bit register; two f16x2 registers leave.
    # is_pure=False keeps the compiler from moving the conversion past the shared-memory stage.
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def _fp8_to_fp16_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, fp8e4m3_to_fp16(x), mask=mask)


def fp8_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn CUDA tensor -> fp16 through fp8e4m3_to_fp16 (for tests)."""
    out = torch.empty(x.shape, dtype=torch.float16, device=x.device)
    n = x.numel()
    _fp8_to_fp16_kernel[(triton.cdiv(n, 1024),)](x, out, n, BLOCK=1024)
    return out


@triton.jit
def fp8e4m3_to_fp16_div256(x, PURE: tl.constexpr):
    # The same widening by integer operations instead of cvt: an e4m3 byte's sign and its
    # exponent+mantissa bits moved into fp16's places give value / 256 exactly (the exponent
    # biases differ by 8), subnormals included. Two byte permutes spread four bytes into two
    # (0, b, 0, b) words; shifts and masks place the bits.
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, s0, s1, u0, u1;
        prmt.b32 t0, $2, 0, 0x4140;
        prmt.b32 t1, $2, 0, 0x4342;
        shl.b32 s0, t0, 8;
        shl.b32 u0, t0, 7;
        and.b32 s0, s0, 0x80008000;
        and.b32 u0, u0, 0x3f803f80;
        or.b32 $0, s0, u0;
        shl.b32 s1, t1, 8;
        shl.b32 u1, t1, 7;
        and.b32 s1, s1, 0x80008000;
        and.b32 u1, u1, 0x3f803f80;
        or.b32 $1, s1, u1;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=PURE,
        pack=4,
    )


@triton.jit
def fp8e4m3_no_widening(x, PURE: tl.constexpr):
    # Timing only (wrong values): the raw bytes handed on as fp16 registers, no conversion work.
    return tl.inline_asm_elementwise(
        asm="mov.b32 $0, $2; mov.b32 $1, $2;",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=PURE,
        pack=4,
    )
