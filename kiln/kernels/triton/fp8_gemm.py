"""FP8 W8A8 GEMMs (twins of reference.quantize_fp8 / fp8_linear): a Triton kernel quantizes the
activations, `torch._scaled_mm` runs the float8 GEMM on the tensor cores. The public fp8_linear
(small_batch_linear.fp8_linear) sends a handful of rows to the small-batch kernels instead.

Which `_scaled_mm` scaling: the weights carry per-output-channel scales and the activations a
per-token (dynamic) or per-tensor (static) one. Rowwise scaling ([M, 1] x [1, N], applied in
the GEMM's epilogue) takes them as they are, but runs 0.63-0.81x bf16 at 1-32 rows. Below
_ROWWISE_MIN_ROWS rows the GEMM instead runs with unit per-tensor scales into fp32 and one Triton
epilogue applies the scales and the bias: 1.02-1.55x bf16 at 1-128 rows. Rowwise wins from 512
rows on every Llama-3.1-8B shape and about ties at 256 (H200, torch 2.11, whole calls in CUDA
graphs).
"""

from __future__ import annotations

import functools
import weakref

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE

# From this many rows on, rowwise-scaled _scaled_mm; below, unit scales and _scale_epilogue
# (see the module docstring).
_ROWWISE_MIN_ROWS = 256


@triton.jit
def round_to_e4m3_grid(v):
    """fp32 -> the nearest e4m3 value (ties to even), still in fp32, for |v| <= 448: the step of
    v's binade (2^(exponent - 3), subnormals 2^-9) from its bits, then the round-to-integer of
    adding and subtracting 2^23. Only the interpreter needs it: Triton 3.x's interpreter rounds
    fp32 -> float8 half-up and drops a carry into the exponent (126.8 gives 64); the GPU's
    conversion rounds correctly, and a value already on the grid converts exactly in both."""
    a = tl.abs(v)
    exponent = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    rounded = ((a / step + 8388608.0) - 8388608.0) * step
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def scaled_to_e4m3(v, scale, inv_scale, DYNAMIC: tl.constexpr, FP8_MAX: tl.constexpr,
                   INTERPRETED: tl.constexpr):  # fmt: skip
    """v / scale, the IEEE quotient, saturated at +-FP8_MAX (on the e4m3 grid under the
    interpreter), from inv_scale = div_rn(1, scale) computed once a row or tensor: 1 FMUL and
    2 FFMA a value instead of div_rn's ~12 instructions (its FCHK range check and slow path).

    q = v * inv_scale is within an ulp or two of the quotient, r = fma(q, scale, -v) is exactly
    its remainder (negated), and fma(r, -inv_scale, q) the correctly rounded quotient
    (Markstein's final correction). The bare product would not do: bf16 activations over a
    bf16 absmax / 448 often land exactly on an e4m3 midpoint, where the quotient rounds half to
    even and the product, an ulp off, mostly away from zero; that bias cost SmolLM2 ~1 point of
    perplexity. The signs are arranged so
    -0 stays -0 (r is +0 there, and +0 * -inv_scale + -0 is -0). With a static scale q is
    clamped first, so that an overflow cannot make inf - inf; a dynamic scale (the row's
    absmax / 448) bounds q by 448 already.
    tests/kernels/test_fp8_reciprocal.py checks the formula against the division at every bf16
    ratio.
    The interpreter divides (numpy's division is IEEE; an emulated fma may round twice)."""
    if INTERPRETED:
        q = round_to_e4m3_grid(tl.clamp(v / scale, -FP8_MAX, FP8_MAX))
    else:
        q = v * inv_scale
        if not DYNAMIC:
            q = tl.clamp(q, -2 * FP8_MAX, 2 * FP8_MAX)
        # v * -1.0, not -v: Triton lowers -v to 0 - v, which loses -0 (LLVM turns the product
        # into a sign flip that folds into the FFMA).
        r = tl.fma(q, scale, v * -1.0)
        q = tl.clamp(tl.fma(r, inv_scale * -1.0, q), -FP8_MAX, FP8_MAX)
    return q


@triton.jit
def store_remainders(v, j, n, scale, inv_scale, out_ptr, DYNAMIC: tl.constexpr,
                     FP8_MAX: tl.constexpr, INTERPRETED: tl.constexpr):  # fmt: skip
    """Outlier columns' second float8 term, reference.fp8_remainder's twin: for the chosen
    channels' values v (fp32, as the row's quantization read them; lanes j < n), stores
    e4m3(v / scale - e4m3(v / scale)) at out_ptr + j. The first term is recomputed as the row's
    own (scaled_to_e4m3, rounded to e4m3); the quotient is div_rn's IEEE one (n values a row:
    its cost does not matter), so the difference is exact and rounds once, as in the reference."""
    first = scaled_to_e4m3(v, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED)
    first = first.to(out_ptr.dtype.element_ty).to(tl.float32)
    rest = tl.clamp(tl.math.div_rn(v, scale) - first, -FP8_MAX, FP8_MAX)
    if INTERPRETED:
        rest = round_to_e4m3_grid(rest)
    tl.store(out_ptr + j, rest.to(out_ptr.dtype.element_ty), mask=j < n)


# Outlier columns make a GEMM's K odd-sized (4096 + 16); cuBLAS's float8 kernels then run 20-33%
# slower unless both operands' rows start 128 bytes apart, at which K + 16 costs what K + 128
# does, +0.4-4% (H200).
ROW_ALIGN = 128


def aligned_rows(num_rows: int, width: int, device: torch.device) -> torch.Tensor:
    """[num_rows, width] float8 e4m3 whose rows are ROW_ALIGN-aligned apart (a view of wider
    rows when width is not a multiple of it)."""
    stride = -(-width // ROW_ALIGN) * ROW_ALIGN
    rows = torch.empty((num_rows, stride), dtype=torch.float8_e4m3fn, device=device)
    return rows[:, :width]


def remainder_args(channels: torch.Tensor | None, out: torch.Tensor) -> dict:
    """The quantizing kernels' outlier-column arguments: the channel indices (any tensor when
    there are none), their count, and REMAINDERS, their lanes (a power of two; 0: none)."""
    if channels is None:
        return {"channels_ptr": out, "n_channels": 0, "REMAINDERS": 0}
    assert channels.dim() == 1 and channels.device == out.device
    n = channels.numel()
    return {"channels_ptr": channels, "n_channels": n, "REMAINDERS": triton.next_power_of_2(n)}


@triton.jit
def _quantize_fp8_kernel(
    x_ptr,  # [M, K]
    out_ptr,  # [M, K + n_channels] float8 e4m3
    scale_ptr,  # [M] fp32 written (DYNAMIC), or [1] fp32 read (static)
    stride_x,
    stride_out,
    K,
    channels_ptr,  # [n_channels] int64: outlier columns, their remainders after column K
    n_channels,
    DYNAMIC: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
    INTERPRETED: tl.constexpr,  # the Triton interpreter: see round_to_e4m3_grid
    REMAINDERS: tl.constexpr = 0,  # lanes for the outlier columns (0: none)
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    if DYNAMIC:
        # Pass 1: the row's absmax; pass 2 (below) re-reads the row, which is in L2 by then.
        absmax = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, K, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
        scale = tl.maximum(tl.math.div_rn(tl.max(absmax, 0), FP8_MAX), MIN_SCALE)
        tl.store(scale_ptr + row, scale)
    else:
        scale = tl.load(scale_ptr)
    # The scale's IEEE reciprocal, once: scaled_to_e4m3 gives the IEEE quotient from it, so the
    # float8 bits equal the reference's (Triton's `/` is approximate on the GPU, and div_rn per
    # value was most of the kernel's arithmetic).
    inv_scale = tl.math.div_rn(1.0, scale)
    for start in range(0, K, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < K
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        q = scaled_to_e4m3(x, scale, inv_scale, DYNAMIC, FP8_MAX, INTERPRETED)
        tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    if REMAINDERS > 0:
        j = tl.arange(0, REMAINDERS)
        channel = tl.load(channels_ptr + j, mask=j < n_channels, other=0)
        v = tl.load(x_row + channel).to(tl.float32)
        out_rest = out_ptr + row * stride_out + K
        store_remainders(v, j, n_channels, scale, inv_scale, out_rest, DYNAMIC, FP8_MAX,
                         INTERPRETED)  # fmt: skip


def quantize_fp8(
    x: torch.Tensor,  # [M, K]
    scale: torch.Tensor | None,  # [] or [1] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K (+ n)] float8 e4m3, [M, 1] or the scale)
    """One program per row; see reference.quantize_fp8 for the contract."""
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    num_rows, k = x.shape
    if channels is None:
        out = torch.empty((num_rows, k), dtype=torch.float8_e4m3fn, device=x.device)
    else:
        out = aligned_rows(num_rows, k + channels.numel(), x.device)
    dynamic = scale is None
    if scale is None:
        scale_arg = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    else:
        assert scale.numel() == 1 and scale.dtype == torch.float32
        scale_arg = scale
    if num_rows > 0:
        _quantize_fp8_kernel[(num_rows,)](
            x,
            out,
            scale_arg,
            x.stride(0),
            out.stride(0),
            k,
            DYNAMIC=dynamic,
            FP8_MAX=FP8_E4M3_MAX,
            MIN_SCALE=FP8_MIN_SCALE,
            BLOCK=min(triton.next_power_of_2(k), 2048),
            INTERPRETED=x.device.type != "cuda",
            **remainder_args(channels, out),
        )
    return out, scale_arg


@triton.jit
def _scale_epilogue_kernel(
    acc_ptr,  # [M, N] fp32: the float8 GEMM with unit scales
    x_scale_ptr,  # [M] fp32 (PER_ROW) or [1]
    w_scale_ptr,  # [N] fp32
    bias_ptr,  # [N] (read when HAS_BIAS)
    out_ptr,  # [M, N] in the model dtype
    N,
    PER_ROW: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.load(acc_ptr + row * N + cols, mask=mask, other=0.0)
    x_scale = tl.load(x_scale_ptr + row) if PER_ROW else tl.load(x_scale_ptr)
    y = acc * x_scale * tl.load(w_scale_ptr + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_epilogue(
    acc: torch.Tensor,  # [M, N] fp32
    x_scale: torch.Tensor,  # [M, 1] or [] / [1] fp32
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None,  # [N]
    dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in dtype
    """(acc * x_scale * weight_scale + bias) rounded once to dtype, in one launch (as torch ops
    it is three or four, which at a handful of rows cost more than the GEMM)."""
    num_rows, n = acc.shape
    out = torch.empty((num_rows, n), dtype=dtype, device=acc.device)
    if num_rows > 0:
        block = 1024
        _scale_epilogue_kernel[(num_rows, triton.cdiv(n, block))](
            acc,
            x_scale,
            weight_scale,
            bias if bias is not None else weight_scale,
            out,
            n,
            PER_ROW=x_scale.numel() == num_rows and x_scale.dim() == 2,
            HAS_BIAS=bias is not None,
            BLOCK=block,
        )
    return out


# A static input scale broadcast to the [M, 1] column that rowwise _scaled_mm takes, kept per
# scale tensor: `expand(M, 1).contiguous()` a call was a copy kernel before every static GEMM
# (128 a Llama-3.1-8B decode step, 0.17 ms of a 33 ms 768-row step on an H200). Keyed by the
# tensor's id and dropped when it is freed; a
# write into the scale (its version counter moves) is copied into the column in place, so CUDA
# graphs captured with the column read the new value as they do the scale's.
_STATIC_COLUMNS: dict[int, tuple[int, torch.Tensor]] = {}
_OUTGROWN_COLUMNS: list[torch.Tensor] = []  # replaced by longer ones; a graph may still read them
_MIN_COLUMN_ROWS = 8192


def _static_column(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 1] contiguous fp32, every row `scale` (a one-element static scale)."""

    def broadcast(length: int) -> torch.Tensor:
        return scale.reshape(1, 1).expand(length, 1).contiguous()

    if scale.is_inference():  # no version counter to follow writes with: not kept
        return broadcast(rows)
    key, version = id(scale), scale._version
    capturing = scale.is_cuda and torch.cuda.is_current_stream_capturing()
    cached = _STATIC_COLUMNS.get(key)
    if cached is not None and cached[1].shape[0] >= rows:
        kept_version, column = cached
        if kept_version == version:
            return column[:rows]
        if not capturing:
            column.copy_(scale.reshape(1, 1).expand_as(column))  # in place: graphs read it
            _STATIC_COLUMNS[key] = (version, column)
            return column[:rows]
    if capturing:
        # Nothing allocated here is kept: it would live in the graph's private pool, which
        # hands its memory to others. Eager steps (the memory profile at
        # max_num_batched_tokens first) fill the cache before any capture.
        return broadcast(rows)
    if cached is None:
        weakref.finalize(scale, _STATIC_COLUMNS.pop, key, None)
    else:
        _OUTGROWN_COLUMNS.append(cached[1])
    length = max(rows, _MIN_COLUMN_ROWS, 0 if cached is None else 2 * cached[1].shape[0])
    column = broadcast(length)
    _STATIC_COLUMNS[key] = (version, column)
    return column[:rows]


@functools.cache
def _one(device: torch.device) -> torch.Tensor:
    return torch.ones((), dtype=torch.float32, device=device)


def fp8_linear(
    x: torch.Tensor,  # [..., K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor; None: dynamic per token
    bias: torch.Tensor | None = None,  # [N] in the model dtype
) -> torch.Tensor:  # [..., N] in x.dtype
    """quantize_fp8 (the Triton kernel), then `torch._scaled_mm` on CUDA. Off CUDA (the Triton
    interpreter in tests) `_scaled_mm` has no kernel, so the GEMM falls back to the reference's
    arithmetic (fp32 sums of the float8 products, scaled after); so does a GEMM whose K or N is
    not a multiple of 16, which `_scaled_mm` rejects."""
    n, k = weight.shape
    x2d = x.reshape(-1, k)
    x_fp8, x_scale = quantize_fp8(x2d, input_scale)
    return fp8_matmul(x_fp8, x_scale, weight, weight_scale, bias, x.dtype).reshape(*x.shape[:-1], n)


def fp8_matmul(
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3, quantized already (quantize_fp8 or a fused norm)
    x_scale: torch.Tensor,  # [M, 1] per row, or [] / [1] per tensor, fp32
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    """fp8_linear after its quantization: the float8 GEMM and its scales."""
    n, k = weight.shape
    num_rows = x_fp8.shape[0]
    if x_fp8.device.type != "cuda" or k % 16 or n % 16:
        acc = x_fp8.float() @ weight.float().t()  # [M, N]: the reference's sums
        return _scale_epilogue(acc, x_scale, weight_scale, bias, out_dtype)
    # use_fast_accum: Hopper's float8 accumulation without periodic promotion to fp32, as vLLM's
    # and TensorRT-LLM's FP8 GEMMs run it: 7-12% faster at 2048-8192 rows on an H200, relative
    # error against the fp32 product 2.1e-3 instead of 1.7e-3 (3.3e-3 at K=14336).
    if num_rows >= _ROWWISE_MIN_ROWS and out_dtype == torch.bfloat16:
        # Rowwise scaling takes an [M, 1] scale_a and a bf16 output only.
        scale_a = x_scale.contiguous() if x_scale.dim() == 2 else _static_column(x_scale, num_rows)
        return torch._scaled_mm(
            x_fp8,
            weight.t(),  # [K, N] column-major, as _scaled_mm wants its second operand
            scale_a=scale_a,
            scale_b=weight_scale.view(1, n),
            bias=bias,
            out_dtype=out_dtype,
            use_fast_accum=True,
        )
    one = _one(x_fp8.device)
    acc = torch._scaled_mm(
        x_fp8,
        weight.t(),
        scale_a=one,
        scale_b=one,
        out_dtype=torch.float32,
        use_fast_accum=True,
    )
    return _scale_epilogue(acc, x_scale, weight_scale, bias, out_dtype)
