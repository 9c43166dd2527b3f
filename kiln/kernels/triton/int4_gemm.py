"""W4A16 GEMM (twin of reference.int4_linear): int4 codes packed 8 to an int32 along K
([N, K / 8], kiln.layers.quantization.int4's layout), dequantized in registers with their group's
scale and zero point, then multiplied in the activations' dtype (fp16 / bf16 tensor-core dots,
fp32 accumulation). The weight is read once per column tile, a quarter of bf16's bytes.

Two kernels: from 9 rows on, tiles of rows through tl.dot on the dequantized weight; 1-8 rows
(decode), _int4_small_batch_kernel, which applies scales and zeros per group instead of per code
(it does not round the dequantized weight to the activations' dtype, so it is at least as exact
as the twin) and splits K over programs to keep enough loads in flight. The 9+ row kernel is not
tuned on a GPU yet. On sm_90, int4_gemm_hopper's Gluon kernel (codes re-laid for mma.sync's
register operand) takes the calls it applies() to. From DEQUANTIZE_ROWS rows on (prefill), the
weight is dequantized once into the activations' dtype (_dequantize_kernel) and cuBLAS
multiplies: the tiled kernel would dequantize it again for every tile of rows.

A layer whose codes were re-laid keeps only that copy (kiln.layers.quantization.int4), so both
kernels here also read them from int4_mma_layout's order (MMA_LAYOUT): the same tiles, each
code's word and nibble found by the layout's index math instead of k // 8 and k % 8."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kiln.kernels.int4_mma_layout import K_STEP, N_ALIGN, N_TILE, repacked_rows
from kiln.kernels.triton import split_k
from kiln.kernels.triton._device import dot_precision, num_sms

try:  # the sm_90 kernel is Gluon's (Triton >= 3.6); older Tritons keep this file's everywhere
    from kiln.kernels.triton import int4_gemm_hopper
except ImportError:  # pragma: no cover (the tested Tritons have Gluon)
    int4_gemm_hopper = None  # type: ignore[assignment]

SMALL_BATCH_ROWS = 8  # up to this many rows: _int4_small_batch_kernel
# From this many rows on: dequantize_int4, then cuBLAS. On an H100 the detour (codes read, bf16
# weight written and read back: N * K * 4.5 bytes at ~3 TB/s) over the bf16 GEMM (2 * M * N * K
# at ~650 TFLOP/s) is ~490 / M of it whatever the shape: half at 1024 rows (a third of the
# call), 6% at 8192, while the tiled kernel (~125 TFLOP/s at 8192 rows) takes ~5x the GEMM. 1024
# also stays above the decode graphs' rows (max_num_seqs, default 256; a capture never takes
# this path in any case), which must not hold a transient weight.
DEQUANTIZE_ROWS = 1024


@triton.jit
def _mma_words(k, offs_n, K):
    """The re-laid word (int4_mma_layout) holding input k of output row n: [N_pad / 16, K / 64,
    8 (g), 4 (t), 2 (h), 2 (s')] for row 16 * nt + 8 * n8 + g, input 64 * it + 32h + 8t + 4s' +
    2 * k8 + k1; broadcasts k against offs_n. Its nibble: _mma_shift."""
    return ((offs_n // 16) * (2 * K) + (k // 64) * 128 + (offs_n % 8) * 16 + ((k // 8) % 4) * 4
            + ((k // 32) % 2) * 2 + (k // 4) % 2)  # fmt: skip


@triton.jit
def _mma_shift(k, offs_n):
    """The bit of input k of row n in its re-laid word: nibble n8 + 2 * k8 + 4 * k1."""
    return 4 * ((offs_n // 8) % 2 + 2 * ((k // 2) % 2) + 4 * (k % 2))


@triton.jit
def _dequantized_tile(w_ptr, s_ptr, z_ptr, k0, n0, N, K, groups, group_size,
                      DTYPE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                      ZERO_IS_MIN: tl.constexpr, MMA_LAYOUT: tl.constexpr):  # fmt: skip
    """The [BLOCK_K, BLOCK_N] weight tile of inputs k0.. (one group: the launcher makes BLOCK_K
    divide the group size) and outputs n0.., as (code - zero) * scale in DTYPE (ZERO_IS_MIN:
    code * scale + min, exact for GGUF's blocks: code * scale takes no rounding). Each int32
    word is loaded once and fanned out to its 8 codes in registers: kiln's layout's word holds
    8 inputs of one row; a re-laid one (MMA_LAYOUT; n0 and BLOCK_N whole 16-row tiles, K a
    multiple of 64, rows padded: no mask) 4 inputs (2 * k8 + k1) of rows g and g + 8 (n8)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    if MMA_LAYOUT:
        # Words [BLOCK_K / 4 quads of inputs, BLOCK_N / 2 (16-row tile, g)], fanned out to
        # [quad, 2 * k8 + k1, tile, n8, g] = [input, row].
        quads = k0 + 4 * tl.arange(0, BLOCK_K // 4)
        pairs = tl.arange(0, BLOCK_N // 2)
        pair_rows = n0 + (pairs // 8) * 16 + pairs % 8
        words = tl.load(w_ptr + _mma_words(quads[:, None], pair_rows[None, :], K))
        words = tl.reshape(words, (BLOCK_K // 4, 1, BLOCK_N // 16, 1, 8))
        words = tl.reshape(tl.broadcast_to(words, (BLOCK_K // 4, 4, BLOCK_N // 16, 2, 8)),
                           (BLOCK_K, BLOCK_N))  # fmt: skip
        codes = (words >> _mma_shift(tl.arange(0, BLOCK_K)[:, None], offs_n[None, :])) & 0xF
    else:
        offs_w = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        mask = (offs_w < K // 8)[:, None] & mask_n[None, :]
        words = tl.load(w_ptr + offs_n[None, :] * (K // 8) + offs_w[:, None], mask=mask, other=0)
        words = tl.reshape(tl.broadcast_to(words[:, None, :], (BLOCK_K // 8, 8, BLOCK_N)),
                           (BLOCK_K, BLOCK_N))  # fmt: skip
        codes = (words >> ((tl.arange(0, BLOCK_K) % 8) * 4)[:, None]) & 0xF
    group = k0 // group_size
    scale = tl.load(s_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
    zero = tl.load(z_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
    if ZERO_IS_MIN:
        return (codes.to(tl.float32) * scale[None, :] + zero[None, :]).to(DTYPE)
    return ((codes.to(tl.float32) - zero[None, :]) * scale[None, :]).to(DTYPE)


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                      groups, group_size, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      ZERO_IS_MIN: tl.constexpr, MMA_LAYOUT: tl.constexpr):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=(offs_m < M)[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        w = _dequantized_tile(w_ptr, s_ptr, z_ptr, k0, tl.program_id(1) * BLOCK_N, N, K, groups,
                              group_size, x.dtype, BLOCK_K, BLOCK_N, ZERO_IS_MIN,
                              MMA_LAYOUT)  # fmt: skip
        acc += tl.dot(x, w, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty),
             mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])  # fmt: skip


@triton.jit
def _code(words, words_hi, j: tl.constexpr, MMA_LAYOUT: tl.constexpr):
    """Code j of each word's 8 inputs (the small-batch kernel's words): bits 4j of kiln's word;
    re-laid, bits 4 * (2 * k8 + 4 * k1) of word s' (j = 4s' + 2 * k8 + k1; n8 shifted out)."""
    if MMA_LAYOUT:
        if j < 4:
            return (words >> (4 * (2 * ((j // 2) % 2) + 4 * (j % 2)))) & 0xF
        return (words_hi >> (4 * (2 * ((j // 2) % 2) + 4 * (j % 2)))) & 0xF
    return (words >> (4 * j)) & 0xF


@triton.jit
def _int4_small_batch_kernel(x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, counter_ptr, M,
                             N, K, stride_xm, stride_ym, groups, group_size, k_per_split,
                             HAS_BIAS: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, DOT: tl.constexpr,
                             PRECISION: tl.constexpr, ZERO_IS_MIN: tl.constexpr,
                             MMA_LAYOUT: tl.constexpr):  # fmt: skip
    """y = sum over groups of scale * (x . codes - zero * sum(x)): the codes (exact in any float
    dtype) meet the activations unscaled and each group's scale and zero apply once per tile
    step, with no per-code dequantization. Code j of every word (inputs 8w + j) is taken in
    turn, so words are never reshaped across threads. One row (DOT off) multiplies and adds in
    fp32 registers; 2-8 rows, padded to ROWS = 16, take tl.dot per j (K = BLOCK_K / 8 >= 16):
    on an H100 at 8 rows, 178 us a Llama-3.1-8B layer against 551 in registers. ZERO_IS_MIN
    (GGUF's code * scale + min): y sums scale * (x . codes) + min * sum(x) instead.
    MMA_LAYOUT: inputs 8w .. 8w + 7 of a row lie in two re-laid words (s' = 0, 1; an 8-byte
    load), code j at nibble n8 + 2 * k8 + 4 * k1 of word s' (j = 4s' + 2 * k8 + k1)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    offs_m = tl.arange(0, ROWS)
    mask_m = offs_m < M
    WORDS: tl.constexpr = BLOCK_K // 8
    word_ks = tl.arange(0, WORDS)
    k_start, k_stop = split_k.k_range(K, k_per_split, SPLIT_K)
    acc = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        # A row's BLOCK_K / 2 bytes of codes are contiguous: each row's words load together.
        offs_w = k0 // 8 + word_ks
        w_mask = offs_w < K // 8
        w_tile_mask = mask_n[:, None] & w_mask[None, :]
        if MMA_LAYOUT:
            # [BLOCK_N, WORDS, s'] (the words of inputs 8w.. are two adjacent ones), each row's
            # nibbles shifted down by 4 * n8 so that code j sits at the same bits in every row.
            pair = _mma_words(8 * offs_w[None, :], offs_n[:, None], K)
            pair = pair[:, :, None] + tl.arange(0, 2)[None, None, :]
            both = tl.load(w_ptr + pair, mask=w_tile_mask[:, :, None], other=0)
            both = both >> (4 * ((offs_n // 8) % 2))[:, None, None]
            words, words_hi = tl.split(both)
        else:
            words = tl.load(w_ptr + offs_n[:, None] * (K // 8) + offs_w[None, :],
                            mask=w_tile_mask, other=0)  # fmt: skip
            words_hi = words
        x_rows = x_ptr + offs_m[:, None] * stride_xm + offs_w[None, :] * 8
        x_mask = mask_m[:, None] & w_mask[None, :]
        x_sum = tl.zeros((ROWS, WORDS), dtype=tl.float32)
        if DOT:
            dot = tl.zeros((BLOCK_N, ROWS), dtype=tl.float32)
            for j in tl.static_range(8):
                x = tl.load(x_rows + j, mask=x_mask, other=0.0)
                codes = _code(words, words_hi, j, MMA_LAYOUT).to(x.dtype)
                dot = tl.dot(codes, tl.trans(x), dot, input_precision=PRECISION)
                x_sum += x.to(tl.float32)
        else:
            products = tl.zeros((BLOCK_N, ROWS, WORDS), dtype=tl.float32)
            for j in tl.static_range(8):
                # 2^23 + code as fp32 bits, minus 2^23: the code as a float without an int
                # conversion instruction.
                codes = _code(words, words_hi, j, MMA_LAYOUT)
                codes = (codes | 0x4B000000).to(tl.float32, bitcast=True)
                codes = codes - 8388608.0
                x = tl.load(x_rows + j, mask=x_mask, other=0.0).to(tl.float32)
                products += codes[:, None, :] * x[None, :, :]
                x_sum += x
            dot = tl.sum(products, axis=2)
        group = k0 // group_size
        scale = tl.load(s_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
        zero = tl.load(z_ptr + offs_n * groups + group, mask=mask_n, other=0.0)
        if ZERO_IS_MIN:
            acc += scale[:, None] * dot + zero[:, None] * tl.sum(x_sum, axis=1)[None, :]
        else:
            acc += scale[:, None] * (dot - zero[:, None] * tl.sum(x_sum, axis=1)[None, :])
    acc = tl.trans(acc)
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        part = offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptr + tl.program_id(1) * (M * N) + part, acc, mask=out_mask)
        is_last = split_k.arrive(counter_ptr, tl.program_id(0), offs_n, SPLIT_K)
        out_mask = out_mask & is_last[None, :]
        acc = split_k.sum_partials(part_ptr, part, out_mask, M * N, SPLIT_K)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, z_ptr, out_ptr, N, K, groups, group_size,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, ZERO_IS_MIN: tl.constexpr,
                       MMA_LAYOUT: tl.constexpr):  # fmt: skip
    """W^T [K, N] in out's dtype: one _dequantized_tile a program, stored as it comes (rows of
    the tile are contiguous in W^T)."""
    n0 = tl.program_id(0) * BLOCK_N
    k0 = tl.program_id(1) * BLOCK_K
    w = _dequantized_tile(w_ptr, s_ptr, z_ptr, k0, n0, N, K, groups, group_size,
                          out_ptr.dtype.element_ty, BLOCK_K, BLOCK_N, ZERO_IS_MIN,
                          MMA_LAYOUT)  # fmt: skip
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    # int64: a large layer's K * N passes 2^31.
    tl.store(out_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :], w,
             mask=(offs_k < K)[:, None] & (offs_n < N)[None, :])  # fmt: skip


def _codes(
    qweight: torch.Tensor | None, mma_weight: torch.Tensor | None, scales: torch.Tensor, k: int
) -> tuple[torch.Tensor, bool]:
    """The codes the kernels read (qweight, else mma_weight) and whether they are re-laid
    (MMA_LAYOUT), checked against K inputs and the scales' rows and groups."""
    n, groups = scales.shape
    weight = qweight if qweight is not None else mma_weight
    if weight is None:
        raise ValueError("int4_linear: no codes (qweight and mma_weight are both None)")
    mma_layout = qweight is None
    if mma_layout and k % K_STEP:
        raise ValueError(f"int4: re-laid codes need K a multiple of {K_STEP}, got {k}")
    expected = (repacked_rows(n) // N_TILE, 2 * k) if mma_layout else (n, k // 8)
    if tuple(weight.shape) != expected or k % groups:
        raise ValueError(f"int4: x [*, {k}] against codes {tuple(weight.shape)} "
                         f"(expected {expected}) and {groups} groups")  # fmt: skip
    return weight, mma_layout


def _block_k(group_size: int, groups: int) -> int:
    """The tiled kernels' K tile: it never straddles two groups; 16 is the smallest a dot takes."""
    block_k = math.gcd(group_size, 64) if groups > 1 else 64
    if block_k < 16:
        raise ValueError(f"int4: group size {group_size} is not a multiple of 16")
    return block_k


def dequantize_int4(
    qweight: torch.Tensor | None,  # [N, K / 8] int32: kiln's packed codes; None: mma_weight's
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32, in code units (8: symmetric)
    zero_is_min: bool = False,  # zeros hold each group's min in weight units instead
    mma_weight: torch.Tensor | None = None,  # the same codes re-laid (int4_mma_layout)
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K] in dtype
    """The whole weight, as the tiled kernel's tiles hold it: (code - zero) * scale (or code *
    scale + min) in fp32, rounded once to dtype. Returned as the transpose of a contiguous
    [K, N], the tiles' own orientation, which F.linear multiplies without a copy."""
    if qweight is not None:
        k = qweight.shape[1] * 8
    elif mma_weight is not None:
        k = mma_weight.shape[1] // 2
    else:
        raise ValueError("dequantize_int4: no codes (qweight and mma_weight are both None)")
    weight, mma_layout = _codes(qweight, mma_weight, scales, k)
    n, groups = scales.shape
    group_size = k // groups
    block_k, block_n = _block_k(group_size, groups), 128
    assert N_ALIGN % block_n == 0  # re-laid: whole 16-row tiles, inside the padded rows
    out = torch.empty(k, n, dtype=dtype, device=weight.device)
    if n and k:
        _dequantize_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
            weight, scales, zeros, out, n, k, groups, group_size, BLOCK_K=block_k,
            BLOCK_N=block_n, ZERO_IS_MIN=zero_is_min, MMA_LAYOUT=mma_layout,
        )  # fmt: skip
    return out.t()


def _small_batch_split(n: int, k: int, block_n: int, block_k: int, per_sm: int,
                       device: torch.device) -> int:  # fmt: skip
    """K splits so the launch has about per_sm programs per SM: one row's projection is a
    weight stream, and one program per column tile leaves too few loads in flight to reach
    HBM's bandwidth (split_k.py)."""
    tiles = triton.cdiv(n, block_n)
    want = triton.next_power_of_2(max(1, per_sm * num_sms(device) // tiles))
    return max(1, min(want, 16, k // block_k))


def int4_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    qweight: torch.Tensor | None,  # [N, K / 8] int32; None: only mma_weight holds the codes
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32
    bias: torch.Tensor | None = None,  # [N]
    zero_is_min: bool = False,  # reference.dequantize_int4's
    mma_weight: torch.Tensor | None = None,  # int4_mma_layout.repack(qweight), where made
) -> torch.Tensor:  # [M, N] in x's dtype
    """The sm_90 Gluon kernel (int4_gemm_hopper) where the codes come re-laid for it and it
    applies(); from DEQUANTIZE_ROWS rows on, dequantize_int4 and cuBLAS; this file's kernels
    otherwise, over qweight, or over mma_weight (MMA_LAYOUT) where a layer keeps only that
    copy. N is the scales' rows."""
    m, k = x.shape
    n, groups = scales.shape
    group_size = k // groups
    weight, mma_layout = _codes(qweight, mma_weight, scales, k)
    hopper = int4_gemm_hopper
    if mma_weight is not None and hopper is not None and hopper.applies(x, k, group_size):
        return hopper.int4_linear_mma(x, mma_weight, scales, zeros, bias, zero_is_min)
    if m >= DEQUANTIZE_ROWS and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
        # Not inside a graph capture: the transient weight would stay in the graph's pool.
        w = dequantize_int4(qweight, scales, zeros, zero_is_min, mma_weight, x.dtype)
        return F.linear(x, w, bias)
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_k = _block_k(group_size, groups)
    bias_arg = bias if bias is not None else scales
    args = (x, weight, scales, zeros, bias_arg, y, m, n, k, x.stride(0), y.stride(0), groups,
            group_size)  # fmt: skip
    if m <= SMALL_BATCH_ROWS:
        # Tiles from an H100 sweep over Llama-3.1-8B's projections (group 128): one row, 128
        # columns at 8 programs an SM (130 us a layer, 158 at 64 and 4); 2-8 rows, 64 at 4.
        block_k = math.gcd(group_size, 128) if groups > 1 else 128
        dot = m > 1 and block_k >= 128
        block_n, per_sm = (64, 4) if dot else (128, 8)
        assert N_ALIGN % block_n == 0  # re-laid: whole 16-row tiles, inside the padded rows
        split = _small_batch_split(n, k, block_n, block_k, per_sm, x.device)
        per_split, num_splits = split_k.k_per_split(k, split, block_k)
        part = counters = y
        if num_splits > 1:
            part = split_k.partials(num_splits, m, n, device=x.device)
            counters = split_k.counters(x.device)
        _int4_small_batch_kernel[(triton.cdiv(n, block_n), num_splits)](
            x, weight, scales, zeros, bias_arg, y, part, counters, m, n, k, x.stride(0),
            y.stride(0), groups, group_size, per_split, HAS_BIAS=bias is not None,
            ROWS=16 if dot else triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
            SPLIT_K=num_splits, DOT=dot, PRECISION=dot_precision(x.dtype),
            ZERO_IS_MIN=zero_is_min, MMA_LAYOUT=mma_layout, num_warps=4, num_stages=3,
        )  # fmt: skip
        return y
    block_m = 16 if m <= 16 else 64
    block_n = 64
    assert N_ALIGN % block_n == 0  # re-laid: whole 16-row tiles, inside the padded rows
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_gemm_kernel[grid](
        *args, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype), BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, ZERO_IS_MIN=zero_is_min, MMA_LAYOUT=mma_layout,
    )  # fmt: skip
    return y
