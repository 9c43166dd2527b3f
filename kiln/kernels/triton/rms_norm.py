"""RMSNorm and fused residual-add + RMSNorm (twins of reference.rms_norm / fused_add_rms_norm),
each with a LayerNorm flavour (`layer_norm=True`, an optional `bias`: StableLM, Cohere,
Starcoder2), a constexpr of the same kernel.

Rounding follows the reference (transformers' LlamaRMSNorm): normalise in fp32, round to the input
dtype, then multiply by the weight in the promoted dtype; the residual sum is rounded to its dtype
before it is normalised.

add_rms_norm_quant_fp8 is the same pass ending in float8 (the input of an FP8 W8A8 projection
above the small-batch kernels' rows): the normed row, rounded as above, is quantized as
quantize_fp8 would quantize it (its absmax / 448, or a static scale), so a projection's input
costs one read of x and one float8 write instead of a bf16 round trip and a second kernel.
add_rms_norm_quant_int8 is that pass for a W8A8 INT8 projection: int8 codes and the row's scale
(its absmax / 127), as quantize_int8 would make them.

The LayerNorm flavour rounds as reference.layer_norm: mean and variance in fp32, the centred row
times rsqrt(variance + eps) times the weight plus the bias in fp32, rounded once to the input
dtype (what the projections after it, or the quantizing variants, read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE, INT8_MAX
from kiln.kernels.triton.fp8_gemm import (
    aligned_rows,
    remainder_args,
    scaled_to_e4m3,
    store_remainders,
)
from kiln.kernels.triton.int8_gemm import scaled_to_int8


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
    scale_ptr,  # QUANT: [num_rows] fp32 written (DYNAMIC), or [1] fp32 read (static)
    channels_ptr,  # QUANT: [n_channels] int64 outlier columns, their remainders after `hidden`
    n_channels,
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= hidden: one row per program
    QUANT: tl.constexpr = False,  # out_ptr is float8 e4m3: quantize the normed row into it
    DYNAMIC: tl.constexpr = True,
    OUT_DTYPE: tl.constexpr = tl.float32,  # QUANT: the dtype the unfused norm would write
    INTERPRETED: tl.constexpr = False,  # the Triton interpreter: see round_to_e4m3_grid
    FP8_MAX: tl.constexpr = 448.0,  # QUANT: the largest code (INT8: 127)
    MIN_SCALE: tl.constexpr = 1e-12,
    REMAINDERS: tl.constexpr = 0,  # QUANT: lanes for the outlier columns (0: none)
    INT8: tl.constexpr = False,  # QUANT: out_ptr is int8 (per-row scales only, no remainders)
    x_norm_weight_ptr=None,  # [hidden], read when X_NORM
    X_NORM: tl.constexpr = False,  # x is RMS-normed by x_norm_weight before the residual add
    bias_ptr=None,  # [hidden], read when HAS_BIAS
    LAYER_NORM: tl.constexpr = False,  # the mean subtracted, rounded once (reference.layer_norm)
    HAS_BIAS: tl.constexpr = False,  # LAYER_NORM: plus a bias
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    inv_rms_x = 0.0
    if X_NORM:
        # reference.sandwich_input: the block's output normed as rms_norm rounds it.
        tl.static_assert(ADD_RESIDUAL, "a lone x-norm is rms_norm's own launch")
        x_in = x.to(tl.float32)
        inv_rms_x = tl.rsqrt(tl.sum(x_in * x_in, 0) / hidden + eps)
        x_weight = tl.load(x_norm_weight_ptr + cols, mask=mask, other=0.0)
        x = ((x_in * inv_rms_x).to(x.dtype).to(tl.float32) * x_weight.to(tl.float32)).to(x.dtype)
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    mean = 0.0
    if LAYER_NORM:
        mean = tl.sum(x32, 0) / hidden
        centred = tl.where(mask, x32 - mean, 0.0)
        inv_rms = tl.rsqrt(tl.sum(centred * centred, 0) / hidden + eps)
        out = centred * inv_rms * weight.to(tl.float32)
        if HAS_BIAS:
            out += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        variance = tl.sum(x32 * x32, 0) / hidden
        inv_rms = tl.rsqrt(variance + eps)
        normed = (x32 * inv_rms).to(x.dtype)
        out = normed.to(tl.float32) * weight.to(tl.float32)
    if QUANT:
        out = out.to(OUT_DTYPE).to(tl.float32)  # what quantize_fp8 would read
        if INT8:
            absmax = tl.max(tl.where(mask, tl.abs(out), 0.0), 0)
            scale = tl.maximum(tl.math.div_rn(absmax, FP8_MAX), MIN_SCALE)
            tl.store(scale_ptr + row, scale)
            q = scaled_to_int8(out, scale, FP8_MAX, INTERPRETED)
            tl.store(out_ptr + row * stride_out + cols, q.to(tl.int8), mask=mask)
        else:
            if DYNAMIC:
                absmax = tl.max(tl.where(mask, tl.abs(out), 0.0), 0)
                scale = tl.maximum(tl.math.div_rn(absmax, FP8_MAX), MIN_SCALE)
                tl.store(scale_ptr + row, scale)
            else:
                scale = tl.load(scale_ptr)
            # The IEEE quotient from the reciprocal, as reference.quantize_fp8 (no division a
            # value).
            inv_scale = tl.math.div_rn(1.0, scale)
            q = scaled_to_e4m3(out, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED)
            tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
            if REMAINDERS > 0:
                # The chosen channels' values again, from their loads (in L1 by now) and the
                # row's inv_rms, by the same operations as above: a register row has no gather.
                j = tl.arange(0, REMAINDERS)
                channel = tl.load(channels_ptr + j, mask=j < n_channels, other=0)
                xj = tl.load(x_ptr + row * stride_x + channel)
                if X_NORM:
                    wxj = tl.load(x_norm_weight_ptr + channel).to(tl.float32)
                    xj32 = (xj.to(tl.float32) * inv_rms_x).to(xj.dtype).to(tl.float32)
                    xj = (xj32 * wxj).to(xj.dtype)
                if ADD_RESIDUAL:
                    rj = tl.load(residual_ptr + row * stride_residual + channel)
                    xj = (xj.to(tl.float32) + rj.to(tl.float32)).to(sum_ptr.dtype.element_ty)
                wj = tl.load(weight_ptr + channel).to(tl.float32)
                if LAYER_NORM:
                    vj = (xj.to(tl.float32) - mean) * inv_rms * wj
                    if HAS_BIAS:
                        vj += tl.load(bias_ptr + channel).to(tl.float32)
                else:
                    vj = (xj.to(tl.float32) * inv_rms).to(xj.dtype).to(tl.float32) * wj
                vj = vj.to(OUT_DTYPE).to(tl.float32)
                out_rest = out_ptr + row * stride_out + hidden
                store_remainders(vj, j, n_channels, scale, inv_scale, out_rest, DYNAMIC, FP8_MAX,
                                 INTERPRETED)  # fmt: skip
    else:
        tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _x_norm_args(x: torch.Tensor, x_norm_weight: torch.Tensor | None) -> dict[str, object]:
    """The kernel's X_NORM arguments (none at all without one: the launch Llama compiles)."""
    if x_norm_weight is None:
        return {}
    assert x_norm_weight.shape == (x.shape[-1],) and x_norm_weight.dtype == x.dtype
    return {"x_norm_weight_ptr": x_norm_weight, "X_NORM": True}


def _norm_args(
    weight: torch.Tensor, bias: torch.Tensor | None, layer_norm: bool
) -> dict[str, object]:
    """The kernel's LayerNorm arguments (none for RMSNorm: the launch Llama compiles)."""
    if not layer_norm:
        assert bias is None, "a norm bias is the LayerNorm flavour's"
        return {}
    args: dict[str, object] = {"LAYER_NORM": True}
    if bias is not None:
        assert bias.shape == weight.shape
        args.update(bias_ptr=bias, HAS_BIAS=True)
    return args


def _out_dtype(weight: torch.Tensor, norm_dtype: torch.dtype, layer_norm: bool) -> torch.dtype:
    """The normed rows' dtype: RMSNorm's weight multiplies in the promoted dtype, LayerNorm
    rounds once to the input's (reference.layer_norm)."""
    return norm_dtype if layer_norm else torch.promote_types(weight.dtype, norm_dtype)


def lone_x_norm(
    x: torch.Tensor, residual: torch.Tensor | None, x_norm_weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x, x_norm_weight) for the fused kernels, which take an x-norm only before a residual
    add and in x's dtype: otherwise x is normed here (its own launch) and the weight dropped."""
    if x_norm_weight is None or (residual is not None and x_norm_weight.dtype == x.dtype):
        return x, x_norm_weight
    return rms_norm(x, x_norm_weight, eps), None


def _launch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    x_norm_weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    layer_norm: bool = False,
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
    out = torch.empty(x2d.shape, dtype=_out_dtype(weight, norm_dtype, layer_norm), device=x.device)
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
            out,  # no scale: unused
            out,  # no outlier columns: unused
            0,
            ADD_RESIDUAL=summed is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 512)),
            **_x_norm_args(x, x_norm_weight),
            **_norm_args(weight, bias, layer_norm),
        )
    out = out.view(x.shape)
    return out, (summed.view(x.shape) if summed is not None else None)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # reference.layer_norm instead
) -> torch.Tensor:
    """Transformers' LlamaRMSNorm: normalise in fp32, scale in the input dtype; with layer_norm,
    reference.layer_norm."""
    return _launch(x, None, weight, eps, None, bias, layer_norm)[0]


def layer_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """reference.layer_norm: rms_norm's kernel in its LayerNorm flavour."""
    return _launch(x, None, weight, eps, None, bias, True)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,
    eps: float,
    x_norm_weight: torch.Tensor | None = None,  # [hidden]: x RMS-normed by it first
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # the norm is reference.layer_norm
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual) in one pass over memory; with
    x_norm_weight, x is reference.sandwich_input(x) (normed in the same pass); with layer_norm,
    (layer_norm(x + residual, weight, bias), x + residual)."""
    x, x_norm_weight = lone_x_norm(x, residual, x_norm_weight, eps)
    normed, summed = _launch(x, residual, weight, eps, x_norm_weight, bias, layer_norm)
    assert summed is not None
    return normed, summed


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def add_rms_norm_quant_fp8(
    x: torch.Tensor,  # [M, hidden]
    residual: torch.Tensor | None,  # [M, hidden], or None: no residual to add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
    x_norm_weight: torch.Tensor | None = None,  # [hidden]: x RMS-normed by it before the add
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # the norm is reference.layer_norm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float8 rms_norm(x + residual), its scale: [M, 1] or input_scale, x + residual): what
    quantize_fp8(fused_add_rms_norm(...)[0], channels=...) gives, in one kernel (the
    reference's twin); with channels the float8 rows are hidden + n wide; with layer_norm the
    LayerNorm flavour's rows."""
    x, x_norm_weight = lone_x_norm(x, residual, x_norm_weight, eps)
    hidden = x.shape[-1]
    assert x.dim() == 2 and weight.shape == (hidden,) and x.stride(-1) == 1
    num_rows = x.shape[0]
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        summed = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
        )
        norm_dtype = summed.dtype
    else:
        summed, norm_dtype = x, x.dtype
    out_dtype = _out_dtype(weight, norm_dtype, layer_norm)
    if channels is None:
        out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    else:
        out = aligned_rows(num_rows, hidden + channels.numel(), x.device)
    dynamic = input_scale is None
    if input_scale is None:
        scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    else:
        assert input_scale.numel() == 1 and input_scale.dtype == torch.float32
        scale = input_scale
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        r2d = residual if residual is not None else x
        _rms_norm_kernel[(num_rows,)](
            x, r2d, weight, out, summed,
            x.stride(0), r2d.stride(0), out.stride(0), summed.stride(0),
            hidden, eps, scale,
            ADD_RESIDUAL=residual is not None, BLOCK=block, QUANT=True, DYNAMIC=dynamic,
            OUT_DTYPE=_TL_DTYPES[out_dtype], INTERPRETED=x.device.type != "cuda",
            FP8_MAX=FP8_E4M3_MAX, MIN_SCALE=FP8_MIN_SCALE,
            num_warps=min(16, max(1, block // 512)), **remainder_args(channels, out),
            **_x_norm_args(x, x_norm_weight), **_norm_args(weight, bias, layer_norm),
        )  # fmt: skip
    return out, scale, summed


def add_rms_norm_quant_int8(
    x: torch.Tensor,  # [M, hidden]
    residual: torch.Tensor | None,  # [M, hidden], or None: no residual to add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # the norm is reference.layer_norm
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ([M, hidden] int8, [M, 1] fp32, sum)
    """(int8 rms_norm(x + residual), its per-row scale, x + residual): what
    quantize_int8(fused_add_rms_norm(...)[0]) gives, in one kernel (the reference's twin);
    with layer_norm the LayerNorm flavour's rows."""
    hidden = x.shape[-1]
    assert x.dim() == 2 and weight.shape == (hidden,) and x.stride(-1) == 1
    num_rows = x.shape[0]
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(-1) == 1
        summed = torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device
        )
        norm_dtype = summed.dtype
    else:
        summed, norm_dtype = x, x.dtype
    out_dtype = _out_dtype(weight, norm_dtype, layer_norm)
    out = torch.empty(x.shape, dtype=torch.int8, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows > 0:
        block = triton.next_power_of_2(hidden)
        r2d = residual if residual is not None else x
        _rms_norm_kernel[(num_rows,)](
            x, r2d, weight, out, summed,
            x.stride(0), r2d.stride(0), out.stride(0), summed.stride(0),
            hidden, eps, scale, out, 0,
            ADD_RESIDUAL=residual is not None, BLOCK=block, QUANT=True, DYNAMIC=True,
            OUT_DTYPE=_TL_DTYPES[out_dtype], INTERPRETED=x.device.type != "cuda",
            FP8_MAX=float(INT8_MAX), MIN_SCALE=FP8_MIN_SCALE, INT8=True,
            num_warps=min(16, max(1, block // 512)), **_norm_args(weight, bias, layer_norm),
        )  # fmt: skip
    return out, scale, summed
