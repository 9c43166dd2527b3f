"""Fused SiLU-and-multiply (twin of reference.silu_and_mul): the Llama MLP's silu(gate) * up over
the fused gate_up projection's output in one pass over memory, instead of a silu, a multiply and
the temporaries between them.

Rounding follows the reference (transformers' LlamaMLP): silu in fp32 rounded to the input dtype,
then the product in fp32 rounded to the input dtype. Both roundings are no-ops in fp32.

silu_and_mul_quant_fp8 is the same pass ending in float8 (the input of an FP8 W8A8 down
projection above the small-batch kernels' rows), as add_rms_norm_quant_fp8 is for qkv and
gate_up: the product, rounded as above, is quantized as quantize_fp8 would quantize it (its row
absmax / 448, or a static scale). At 512 decode rows of Llama-3.1-8B this replaces a SiLU-mul
(10.7 us: 29 MB read, 15 MB written) and a quantize kernel (~12 us: the 15 MB read twice, 7 MB
written) with one pass that reads 29 MB and writes 7 MB.

silu_and_mul_quant_int8 (and GeGLU's) is the dynamic pass ending in int8 instead (a W8A8 INT8
down projection's input): the row's absmax / 127 and codes rounded as quantize_int8 rounds them.

gelu_tanh_and_mul (and its _quant_fp8) are the same kernels with GeGLU's activation (Gemma:
transformers' gelu_pytorch_tanh), picked by a constexpr, so SiLU's compiled code is unchanged.
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

_MAX_BLOCK = 1024
# silu_and_mul_quant_fp8 holds a whole row in registers up to this width (one pass over HBM,
# no re-read for the absmax): Llama-3.1-8B's 14336 fits, 16 warps holding 32 values a thread.
# Wider rows take two passes of _QUANT_LOOP_BLOCK (a power of two) columns, the second
# re-reading the row (from L2, like quantize_fp8's kernel).
_QUANT_ONE_PASS_MAX = 16384
_QUANT_LOOP_BLOCK = 4096


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate in columns [0, d), up in [d, 2d)
    out_ptr,  # [num_rows, d]
    stride_x,
    stride_out,
    d,
    BLOCK: tl.constexpr,
    GELU: tl.constexpr = False,  # gelu_pytorch_tanh(gate) * up
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    # torch's silu: x / (1 + exp(-x)) in fp32 (a large negative x gives -0, not NaN).
    act = (_gelu_tanh_f32(g) if GELU else g / (1.0 + tl.exp(-g))).to(gate.dtype)
    out = act.to(tl.float32) * up.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_f32(g):
    """torch's gelu(approximate="tanh") in fp32: 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))),
    tanh(y) as 1 - 2 / (1 + exp(2y)) (saturating to +-1 where exp over- or underflows)."""
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    t = 1.0 - 2.0 / (1.0 + tl.exp(2.0 * inner))
    return 0.5 * g * (1.0 + t)


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
) -> torch.Tensor:  # [num_tokens, d]
    """silu(gate) * up, rounded like transformers' LlamaMLP in the input dtype."""
    return _act_and_mul(x, gelu=False)


def gelu_tanh_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
) -> torch.Tensor:  # [num_tokens, d]
    """gelu_pytorch_tanh(gate) * up (GeGLU), rounded like transformers' GemmaMLP."""
    return _act_and_mul(x, gelu=True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
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
            **({"GELU": True} if gelu else {}),
        )
    return out.view(*x.shape[:-1], d)


@triton.jit
def _silu_f32(g, INTERPRETED: tl.constexpr):
    """g / (1 + exp(-g)) in fp32 as the GPU computes Triton's `g / (1.0 + tl.exp(-g))`, with
    the two SFU instructions that form uses and without its special-case code (~7 of the
    quantizing kernel's ~28 SASS instructions a value):
    tl.exp is ex2.approx.f32 of g * -log2(e), whose non-ftz form rescales inputs below -126
    (results that are subnormal, where 1 + exp(-g) is 1 either way: ftz gives the same sum);
    `/` is div.full.f32, the reciprocal of 1 + exp(-g) times g, after rescaling both by 1/4
    when the denominator exceeds 2^126. Here rcp.approx.ftz.f32 (the same MUFU.RCP) flushes
    that case's subnormal reciprocal: for g < -87.3, silu(g) is -0 instead of a value under
    6e-37 in magnitude. Quantized, both are a zero code of the same sign (the scale is at least
    FP8_MIN_SCALE = 1e-12), so silu_and_mul_quant_fp8's float8 output is unchanged. The
    interpreter has no inline PTX: it computes the plain form (numpy's exact division)."""
    if INTERPRETED:
        return g / (1.0 + tl.exp(-g))
    minus_g_log2e = g * -1.4426950408889634  # the fp32 product tl.exp(-g) feeds ex2
    e = tl.inline_asm_elementwise(
        "ex2.approx.ftz.f32 $0, $1;", "=r,r", [minus_g_log2e], dtype=tl.float32, is_pure=True,
        pack=1,
    )  # fmt: skip
    r = tl.inline_asm_elementwise(
        "rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32, is_pure=True, pack=1
    )
    return g * r


@triton.jit
def _silu_mul_block(x_row, cols, d, INTERPRETED: tl.constexpr, GELU: tl.constexpr = False):
    """silu(gate) * up (GELU: gelu_tanh(gate) * up) over columns `cols` of one row, rounded as
    _silu_and_mul_kernel rounds it (to the input dtype twice), returned in fp32: what
    quantize_fp8 would read."""
    mask = cols < d
    gate = tl.load(x_row + cols, mask=mask, other=0.0)
    up = tl.load(x_row + d + cols, mask=mask, other=0.0)
    if GELU:
        act = _gelu_tanh_f32(gate.to(tl.float32)).to(gate.dtype)
    else:
        act = _silu_f32(gate.to(tl.float32), INTERPRETED).to(gate.dtype)
    return (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)


@triton.jit
def _to_codes(v, scale, inv_scale, DYNAMIC: tl.constexpr, FP8_MAX: tl.constexpr,
              INTERPRETED: tl.constexpr, INT8: tl.constexpr):  # fmt: skip
    """A row's fp32 values as the codes its output holds: e4m3 (scaled_to_e4m3), or with INT8
    the int8 grid (scaled_to_int8, FP8_MAX then 127); still fp32."""
    if INT8:
        q = scaled_to_int8(v, scale, FP8_MAX, INTERPRETED)
    else:
        q = scaled_to_e4m3(v, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED)
    return q


@triton.jit
def _silu_and_mul_quant_fp8_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate in columns [0, d), up in [d, 2d)
    out_ptr,  # [num_rows, d + n_channels] float8 e4m3 (INT8: [num_rows, d] int8)
    scale_ptr,  # [num_rows] fp32 written (DYNAMIC), or [1] fp32 read (static)
    stride_x,
    stride_out,
    d,
    channels_ptr,  # [n_channels] int64: outlier columns, their remainders after column d
    n_channels,
    DYNAMIC: tl.constexpr,
    ONE_PASS: tl.constexpr,  # BLOCK >= d: the row is held in registers, read once
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,  # the largest code (INT8: 127)
    MIN_SCALE: tl.constexpr,
    INTERPRETED: tl.constexpr,  # the Triton interpreter: see fp8_gemm.round_to_e4m3_grid
    REMAINDERS: tl.constexpr = 0,  # lanes for the outlier columns (0: none)
    GELU: tl.constexpr = False,
    INT8: tl.constexpr = False,  # int8 codes (DYNAMIC, no remainders)
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_out
    if ONE_PASS:
        cols = tl.arange(0, BLOCK)
        v = _silu_mul_block(x_row, cols, d, INTERPRETED, GELU)
        if DYNAMIC:
            absmax = tl.max(tl.where(cols < d, tl.abs(v), 0.0), 0)
            scale = tl.maximum(tl.math.div_rn(absmax, FP8_MAX), MIN_SCALE)
            tl.store(scale_ptr + row, scale)
        else:
            scale = tl.load(scale_ptr)
        inv_scale = tl.math.div_rn(1.0, scale)
        q = _to_codes(v, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED, INT8)
        tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=cols < d)
    else:
        if DYNAMIC:
            # Pass 1: the row's absmax; pass 2 recomputes each block (its inputs are in L2).
            absmax = tl.zeros((BLOCK,), dtype=tl.float32)
            for start in range(0, d, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                v = _silu_mul_block(x_row, cols, d, INTERPRETED, GELU)
                absmax = tl.maximum(absmax, tl.where(cols < d, tl.abs(v), 0.0))
            scale = tl.maximum(tl.math.div_rn(tl.max(absmax, 0), FP8_MAX), MIN_SCALE)
            tl.store(scale_ptr + row, scale)
        else:
            scale = tl.load(scale_ptr)
        inv_scale = tl.math.div_rn(1.0, scale)
        for start in range(0, d, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            v = _silu_mul_block(x_row, cols, d, INTERPRETED, GELU)
            q = _to_codes(v, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED, INT8)
            tl.store(out_row + cols, q.to(out_ptr.dtype.element_ty), mask=cols < d)
    if REMAINDERS > 0:
        _store_silu_mul_remainders(
            x_row, out_row + d, d, channels_ptr, n_channels, scale, inv_scale, DYNAMIC, FP8_MAX,
            INTERPRETED, REMAINDERS, GELU,
        )  # fmt: skip


@triton.jit
def _store_silu_mul_remainders(x_row, out_rest, d, channels_ptr, n_channels, scale, inv_scale,
                               DYNAMIC: tl.constexpr, FP8_MAX: tl.constexpr,
                               INTERPRETED: tl.constexpr, REMAINDERS: tl.constexpr,
                               GELU: tl.constexpr = False):  # fmt: skip
    """The outlier columns' remainders of one row: their activations recomputed from their
    gate and up (_silu_mul_block over the chosen columns, the same arithmetic as the row's)."""
    j = tl.arange(0, REMAINDERS)
    channel = tl.load(channels_ptr + j, mask=j < n_channels, other=0)
    v = _silu_mul_block(x_row, channel, d, INTERPRETED, GELU)
    store_remainders(v, j, n_channels, scale, inv_scale, out_rest, DYNAMIC, FP8_MAX, INTERPRETED)


@triton.jit
def _silu_and_mul_quant_fp8_static_kernel(
    x_ptr,  # [num_rows, 2 * d]: gate in columns [0, d), up in [d, 2d)
    out_ptr,  # [num_rows, d + n_channels] float8 e4m3
    scale_ptr,  # [1] fp32: the static scale
    stride_x,
    stride_out,
    d,
    channels_ptr,  # [n_channels] int64: outlier columns, their remainders after column d
    n_channels,
    BLOCK: tl.constexpr,
    FP8_MAX: tl.constexpr,
    INTERPRETED: tl.constexpr,
    REMAINDERS: tl.constexpr = 0,  # lanes for the outlier columns (0: none)
    GELU: tl.constexpr = False,
):
    """A static scale needs no row maximum, so each program takes BLOCK columns of one row
    (grid: rows x column blocks) instead of a whole row: small programs, many of them, which
    keep more loads in flight where the rows are few (_STATIC_GRID_MAX_ROWS)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x_row = x_ptr + row * stride_x
    v = _silu_mul_block(x_row, cols, d, INTERPRETED, GELU)
    scale = tl.load(scale_ptr)
    inv_scale = tl.math.div_rn(1.0, scale)
    q = scaled_to_e4m3(v, scale, inv_scale, False, FP8_MAX, INTERPRETED)
    tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=cols < d)
    # Nested: a constexpr test first, so the kernel without outlier columns has no branch.
    if REMAINDERS > 0:  # noqa: SIM102
        if tl.program_id(1) == 0:  # one program a row writes them
            _store_silu_mul_remainders(x_row, out_ptr + row * stride_out + d, d, channels_ptr,
                                       n_channels, scale, inv_scale, False, FP8_MAX, INTERPRETED,
                                       REMAINDERS, GELU)  # fmt: skip


# Up to this many rows a static scale takes the column grid. H200, d 14336, HBM-resident inputs:
# 1024 columns and 4 warps 10-18% faster than the row kernel at 64-1000 rows (960: 20.1 -> 17.7 us);
# at 8192 and 16384 rows the row kernel 1.5-2.7% faster than the grid's best (137.1 against 138.5 us
# at 8192). Not measured between 1000 and 8192; the switch sits between them.
_STATIC_GRID_MAX_ROWS = 4096


def _static_quant_tiles(d: int, num_rows: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of _silu_and_mul_quant_fp8_static_kernel (a function, so a sweep can
    force each)."""
    return min(1024, triton.next_power_of_2(d)), 4


def _quant_tiles(d: int, num_rows: int) -> tuple[bool, int, int]:
    """(one pass, BLOCK, num_warps) of _silu_and_mul_quant_fp8_kernel for rows of width d (a
    function, so a sweep can force each)."""
    # Read at call time (host side), so tests can lower them to run the two-pass loop.
    one_pass = d <= _QUANT_ONE_PASS_MAX
    block = triton.next_power_of_2(d) if one_pass else _QUANT_LOOP_BLOCK
    return one_pass, block, min(16, max(1, block // 1024))


def silu_and_mul_quant_fp8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d (+ n)] float8 e4m3, [M, 1] or input_scale)
    """quantize_fp8(silu_and_mul(x), input_scale, channels) in one kernel (the reference's
    twin)."""
    return _act_and_mul_quant_fp8(x, input_scale, channels, gelu=False)


def gelu_tanh_and_mul_quant_fp8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d (+ n)] float8 e4m3, [M, 1] or input_scale)
    """quantize_fp8(gelu_tanh_and_mul(x), input_scale, channels) in one kernel."""
    return _act_and_mul_quant_fp8(x, input_scale, channels, gelu=True)


def _act_and_mul_quant_fp8(
    x: torch.Tensor, input_scale: torch.Tensor | None, channels: torch.Tensor | None, gelu: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.shape[1] % 2 == 0
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, d = x.shape[0], x.shape[1] // 2
    if channels is None:
        out = torch.empty((num_rows, d), dtype=torch.float8_e4m3fn, device=x.device)
    else:
        out = aligned_rows(num_rows, d + channels.numel(), x.device)
    dynamic = input_scale is None
    activation = {"GELU": True} if gelu else {}  # SiLU's launch is as it was
    if input_scale is None:
        scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    else:
        assert input_scale.numel() == 1 and input_scale.dtype == torch.float32
        scale = input_scale
    if num_rows > 0 and d > 0 and not dynamic and num_rows <= _STATIC_GRID_MAX_ROWS:
        block, num_warps = _static_quant_tiles(d, num_rows)
        # Rows on grid axis 0 (2^31 - 1 programs); column blocks on axis 1 (at most 65535).
        _silu_and_mul_quant_fp8_static_kernel[(num_rows, triton.cdiv(d, block))](
            x, out, scale, x.stride(0), out.stride(0), d,
            BLOCK=block, FP8_MAX=FP8_E4M3_MAX, INTERPRETED=x.device.type != "cuda",
            num_warps=num_warps, **remainder_args(channels, out), **activation,
        )  # fmt: skip
    elif num_rows > 0 and d > 0:
        one_pass, block, num_warps = _quant_tiles(d, num_rows)
        _silu_and_mul_quant_fp8_kernel[(num_rows,)](
            x, out, scale, x.stride(0), out.stride(0), d,
            DYNAMIC=dynamic, ONE_PASS=one_pass, BLOCK=block,
            FP8_MAX=FP8_E4M3_MAX, MIN_SCALE=FP8_MIN_SCALE, INTERPRETED=x.device.type != "cuda",
            num_warps=num_warps, **remainder_args(channels, out), **activation,
        )  # fmt: skip
    return out, scale


def silu_and_mul_quant_int8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d] int8, [M, 1] fp32)
    """quantize_int8(silu_and_mul(x)) in one kernel (the reference's twin)."""
    return _act_and_mul_quant_int8(x, gelu=False)


def gelu_tanh_and_mul_quant_int8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d] int8, [M, 1] fp32)
    """quantize_int8(gelu_tanh_and_mul(x)) in one kernel."""
    return _act_and_mul_quant_int8(x, gelu=True)


def _act_and_mul_quant_int8(x: torch.Tensor, gelu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    assert x.dim() == 2 and x.shape[1] % 2 == 0
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, d = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, d), dtype=torch.int8, device=x.device)
    scale = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    if num_rows > 0 and d > 0:
        one_pass, block, num_warps = _quant_tiles(d, num_rows)
        _silu_and_mul_quant_fp8_kernel[(num_rows,)](
            x, out, scale, x.stride(0), out.stride(0), d,
            DYNAMIC=True, ONE_PASS=one_pass, BLOCK=block,
            FP8_MAX=float(INT8_MAX), MIN_SCALE=FP8_MIN_SCALE,
            INTERPRETED=x.device.type != "cuda", num_warps=num_warps,
            GELU=gelu, INT8=True, **remainder_args(None, out),
        )  # fmt: skip
    return out, scale
