"""RMSNorm and fused residual-add + RMSNorm (twins of reference.rms_norm / fused_add_rms_norm).

Rounding follows the reference (transformers' LlamaRMSNorm): normalise in fp32, round to the input
dtype, then multiply by the weight in the promoted dtype; the residual sum is rounded to its dtype
before it is normalised.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, hidden]
    residual_ptr,  # [num_rows, hidden] (read when ADD_RESIDUAL)
    weight_ptr,  # [hidden]
    out_ptr,  # [num_rows, hidden]
    sum_ptr,  # [num_rows, hidden]: x + residual (written when ADD_RESIDUAL)
    stride_x,
    stride_residual,
    stride_out,
    stride_sum,
    hidden,
    eps,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden: one row per program
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, 0) / hidden
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    assert weight.shape == (hidden,)
    x2d = x.reshape(-1, hidden)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    summed = None
    if residual is not None:
        assert residual.shape == x.shape
        r2d = residual.reshape(-1, hidden)
        if r2d.stride(-1) != 1:
            r2d = r2d.contiguous()
        summed = torch.empty(
            x2d.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
        )
        norm_dtype = summed.dtype
    else:
        r2d = x2d  # unused by the kernel
        norm_dtype = x.dtype
    out = torch.empty(
        x2d.shape, dtype=torch.promote_types(weight.dtype, norm_dtype), device=x.device
    )
    num_rows = x2d.shape[0]
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(num_rows,)](
            x2d,
            r2d,
            weight,
            out,
            summed if summed is not None else out,
            x2d.stride(0),
            r2d.stride(0),
            out.stride(0),
            summed.stride(0) if summed is not None else 0,
            hidden,
            eps,
            ADD_RESIDUAL=summed is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
        )
    out = out.view(x.shape)
    return out, (summed.view(x.shape) if summed is not None else None)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:
    """Transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) in one pass over memory."""
    normed, summed = _launch(x, residual, weight, eps)
    assert summed is not None
    return normed, summed
