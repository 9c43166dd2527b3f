"""Fused SiLU-and-multiply (twin of reference.silu_and_mul): the Llama MLP's silu(gate) * up over
the fused gate_up projection's output in one pass over memory, instead of a silu, a multiply and
the temporaries between them.

Rounding follows the reference (transformers' LlamaMLP): silu in fp32 rounded to the input dtype,
then the product in fp32 rounded to the input dtype. Both roundings are no-ops in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate in columns [0, d), up in [d, 2d)
    out_ptr,  # [num_rows, d]
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in fp32 (a large negative x gives -0, not NaN).
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
) -> torch.Tensor:  # [num_tokens, d]
    """silu(gate) * up, rounded like transformers' LlamaMLP in the input dtype."""
    two_d = x.shape[-1]
    assert two_d % 2 == 0, f"last dim {two_d} is not gate and up halves"
    d = two_d // 2
    x2d = x.reshape(-1, two_d)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    num_rows = x2d.shape[0]
    out = torch.empty((num_rows, d), dtype=x.dtype, device=x.device)
    if num_rows > 0 and d > 0:
        block = min(_MAX_BLOCK, triton.next_power_of_2(d))
        # Rows on grid axis 0 (2^31 - 1 programs); column blocks on axis 1 (at most 65535).
        grid = (num_rows, triton.cdiv(d, block))
        _silu_and_mul_kernel[grid](
            x2d,
            out,
            x2d.stride(0),
            out.stride(0),
            d,
            BLOCK=block,
            num_warps=max(1, min(4, block // 256)),
        )
    return out.view(*x.shape[:-1], d)
