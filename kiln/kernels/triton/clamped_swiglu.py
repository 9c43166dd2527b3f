"""gpt-oss's expert activation in one pass (twin of reference.clamped_swiglu): over the experts'
gate_up rows, gate clamped above at `limit`, up to +-`limit`, and (up + 1) * gate *
sigmoid(alpha * gate), computed in fp32 and rounded once to the input dtype (the reference
rounds after each of transformers' ops: the same in fp32, within a rounding or two in bf16)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 1024


@triton.jit
def _clamped_swiglu_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate in columns [0, d), up in [d, 2d)
    out_ptr,  # [num_rows, d]
    stride_x,
    stride_out,
    d,
    alpha,
    limit,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    glu = gate / (1.0 + tl.exp(-alpha * gate))  # gate * sigmoid(alpha * gate)
    out = (up + 1.0) * glu
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def clamped_swiglu(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [num_tokens, d]
    two_d = x.shape[-1]
    assert two_d % 2 == 0, f"last dim {two_d} is not gate and up halves"
    d = two_d // 2
    x2d = x.reshape(-1, two_d)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    out = torch.empty((x2d.shape[0], d), dtype=x.dtype, device=x.device)
    if x2d.shape[0] > 0 and d > 0:
        block = min(_MAX_BLOCK, triton.next_power_of_2(d))
        grid = (x2d.shape[0], triton.cdiv(d, block))
        _clamped_swiglu_kernel[grid](
            x2d, out, x2d.stride(0), out.stride(0), d, float(alpha), float(limit),
            BLOCK=block, num_warps=max(1, min(4, block // 256)),
        )  # fmt: skip
    return out.view(*x.shape[:-1], d)
