"""W4A16 for Hopper (sm_90) in Gluon, Marlin's way (twin: reference.int4_linear over the codes
kiln.kernels.int4_mma_layout.unrepack gives back): y^T = W @ x^T on mma.sync m16n8k16, the
dequantized weights as the register operand A, x^T (rows padded to 8) as B. Output columns are
the MMA's M dimension, so at one row no weight is multiplied in vain.

The codes come re-laid by int4_mma_layout.repack: one 16-byte load a lane a loop step is its
four A fragments in register order, and each 32-bit A register is one shift and one LOP3 away,
`(word >> s) & 0x000F000F | MAGIC`: two 16-bit floats OFFSET + code (bf16 128 + c, fp16
1024 + c, exact). No shared memory, no layout conversion of the weights. x is loaded the same
way, two 16-byte loads a lane (the layout's input order makes a lane's inputs contiguous).

The arithmetic is the small-batch kernel's: the codes meet x unscaled, and each group's part of
a loop iteration (128 inputs, or 64 or 32 with smaller groups) adds scale * (dot - (OFFSET +
zero) * sum(x)) to an fp32 accumulator (ZERO_IS_MIN, GGUF's code * scale + min: scale * (dot -
OFFSET * sum(x)) + min * sum(x)). dot sums at most 128 products, so OFFSET * sum(x) cancels with
fp32's error at that scale; the weights are never rounded to x's dtype, so the result is at
least as exact as the twin's. sum(x) is one more MMA a k16 step, A all ones, landing in the
accumulator's own layout.

One program: a tile of 16 * num_warps output columns (a warp's 16), ROWS rows of x, one slice of
K (split-K, as kiln.kernels.triton.split_k does it: partials, a ticket, the last program sums
them in order). A loop iteration takes two steps (128 inputs, groups of 128 and more applied once
an iteration); the next iteration's loads are issued before this one's MMAs.

Covered: bf16 and fp16 activations, groups of 32, 64, 128, 256, ... and per channel (K a multiple
of 128), zero points and ZERO_IS_MIN, up to MAX_ROWS rows. Not covered (int4_gemm's kernels keep
them, over the same re-laid codes where a layer holds only those): groups of 16 or of 64 * a
non-power of two, K not a multiple of 128, fp32 activations, more than MAX_ROWS rows. Selected
for the activation dtypes in SELECTED (bf16 and fp16: on an H100 it runs a Llama-3.1-8B layer
2.0-2.6x faster than int4_gemm's kernels at 1-32 rows); int4_gemm.int4_linear runs the rest."""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2

from kiln.kernels.int4_mma_layout import K_STEP, N_ALIGN, N_TILE, repacked_rows
from kiln.kernels.triton import split_k
from kiln.kernels.triton._device import num_sms

# Names that differ between Triton 3.6 (the GPU machines') and later releases.
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier

NUM_WARPS = 4  # 64 output columns a program
MAX_ROWS = 32  # more rows: int4_gemm's kernels (64 would spill: 255 registers)
MAX_SPLIT = 16
PROGRAMS_PER_SM = 8  # split-K target: enough 16-byte loads in flight to stream HBM
# (bits OR-ed onto a nibble pair, the float that makes) for each activation dtype.
_MAGIC = {torch.bfloat16: (0x43004300, 128.0), torch.float16: (0x64006400, 1024.0)}

# The activation dtypes int4_linear hands to this kernel where supports() holds: it passed
# tests/kernels/test_int4_gemm_hopper.py and beat int4_gemm's kernels in
# benchmarks/kernels_gpu.py --only int4 on an H100.
SELECTED: set[torch.dtype] = {torch.bfloat16, torch.float16}


def group_shift(k: int, group_size: int) -> int | None:
    """The kernel's GROUP_SHIFT: loop step s is in group s >> GROUP_SHIFT (groups of 64 * 2^i
    inputs; 31 per channel: every step in group 0; 0 for groups of 32, two a step). None: a K
    or group size this kernel does not take (K not a multiple of 128, two steps a loop
    iteration; groups of 16, or of 64 * a non-power of two), left to int4_gemm's kernels."""
    steps = group_size // K_STEP
    if k % (2 * K_STEP) or k % group_size:  # two steps a loop iteration
        return None
    if group_size == k:
        return 31
    if group_size == 32:
        return 0
    if group_size % K_STEP or steps & (steps - 1):
        return None
    return steps.bit_length() - 1


def usable(device: torch.device, k: int, group_size: int) -> bool:
    """Whether a layer's codes should be repacked for this kernel at load: an sm_90 GPU, a
    selected dtype, K and the group size as group_shift takes them."""
    return (
        bool(SELECTED)
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) == (9, 0)
        and group_shift(k, group_size) is not None
    )


def supports(x: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether this kernel runs a call (the codes repacked): x bf16 / fp16 of at most MAX_ROWS
    rows on an sm_90 GPU, K and the group size as group_shift takes them."""
    return (
        x.is_cuda
        and x.dtype in _MAGIC
        and x.shape[0] <= MAX_ROWS
        and torch.cuda.get_device_capability(x.device) == (9, 0)
        and group_shift(k, group_size) is not None
    )


def applies(x: torch.Tensor, k: int, group_size: int) -> bool:
    """Whether int4_gemm.int4_linear hands this call to this kernel."""
    return x.dtype in SELECTED and supports(x, k, group_size)


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


def words_layout(num_warps: int) -> gl.DistributedLinearLayout:
    """A loop step's words [warp, g, t, s]: lane 4g + t, its four MMA steps' words in registers
    (one 16-byte load)."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 0, 1], [0, 0, 0, 2]],
        lane_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [0, 1, 0, 0], [0, 2, 0, 0], [0, 4, 0, 0]],
        warp_bases=[[w, 0, 0, 0] for w in _bits(num_warps)],
        block_bases=[],
        shape=[num_warps, 8, 4, 4],
    )


def x_layout(rows: int, num_warps: int) -> gl.DistributedLinearLayout:
    """A loop step's x as int32 pairs [h, t, p, row] (inputs 32h + 8t + 2p and + 1 of the step):
    lane 4 * (row % 8) + t, its 8 inputs of each half in registers (16-byte loads); every warp
    loads the same. Pairs, not 16-bit values, cross the loop: they stay whole registers."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0]]
        + [[0, 0, 0, 8 * r] for r in _bits(rows // 8)],
        lane_bases=[[0, 1, 0, 0], [0, 2, 0, 0], [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]],
        warp_bases=[[0, 0, 0, 0] for _ in _bits(num_warps)],
        block_bases=[],
        shape=[2, 4, 4, rows],
    )


@gluon.jit
def _index4(SIZE: gl.constexpr, DIM: gl.constexpr, layout: gl.constexpr):
    """arange(SIZE) along dimension DIM of a rank-4 layout, expanded to rank 4."""
    if DIM == 0:
        i = gl.arange(0, SIZE, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 1), 2), 3)
    elif DIM == 1:
        i = gl.arange(0, SIZE, gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 2), 3)
    elif DIM == 2:
        i = gl.arange(0, SIZE, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 1), 3)
    else:
        i = gl.arange(0, SIZE, gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout))))
        return gl.expand_dims(gl.expand_dims(gl.expand_dims(i, 0), 1), 2)


@gluon.jit
def _pairs(word, shift: gl.constexpr, MAGIC: gl.constexpr):
    """The two codes at bits shift and shift + 16 as 16-bit floats OFFSET + code, in one int32:
    one LOP3 ((a & b) | c, lut 0xEA), which ptxas does not form from the AND and the OR of two
    constants by itself."""
    shifted = word >> shift
    magic = gl.full(word.shape, MAGIC, gl.int32, word.type.layout)
    return gl.inline_asm_elementwise(
        "lop3.b32 $0, $1, 0x000F000F, $2, 0xEA;", "=r,r,r", [shifted, magic], gl.int32,
        is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _a_operand(word, MAGIC: gl.constexpr, DTYPE: gl.constexpr, a_layout: gl.constexpr):
    """One MMA step's words [warp, g, t] -> its A tile [16 * warps, 16] (OFFSET + codes), in the
    MMA's register order: every reshape here moves no data (assert_trivial)."""
    # Nibble pair n8 + 2 * k8; joined k8 inner, then n8.
    lo_rows = gl.join(_pairs(word, 0, MAGIC), _pairs(word, 8, MAGIC))
    hi_rows = gl.join(_pairs(word, 4, MAGIC), _pairs(word, 12, MAGIC))
    a = _halves(gl.join(lo_rows, hi_rows), DTYPE)  # [warp, g, t, k8, n8, k1]
    a = gl.permute(a, (0, 4, 1, 3, 2, 5))  # [warp, n8, g, k8, t, k1]
    a = gl.reshape(a, (a.shape[0] * 16, 16))
    return gl.convert_layout(a, a_layout, assert_trivial=True)


@gluon.jit
def _halves(pairs, DTYPE: gl.constexpr):
    """int32 pairs [...] -> their two 16-bit floats [..., 2], low half first (no instruction
    once the MMA packs them back)."""
    low = (pairs & 0xFFFF).to(gl.int16).to(DTYPE, bitcast=True)
    high = (pairs >> 16).to(gl.int16).to(DTYPE, bitcast=True)
    return gl.join(low, high)


@gluon.jit
def _b_operands(x, DTYPE: gl.constexpr, b_layout: gl.constexpr):
    """A loop step's x pairs [h, t, p, row] -> the four MMA steps' B tiles [16, rows]: step
    2h + s' takes the step's input 32h + 8t + 4s' + 2 * k8 + k1 as MMA row 8 * k8 + 2t + k1."""
    ROWS: gl.constexpr = x.shape[3]
    x = _halves(x, DTYPE)  # [h, t, p, row, k1]
    x = gl.reshape(x, (2, 4, 2, 2, ROWS, 2))  # [h, t, s', k8, row, k1]
    x = gl.permute(x, (3, 1, 5, 4, 0, 2))  # [k8, t, k1, row, h, s']
    even, odd = gl.split(x)  # s' = 0, 1
    b0, b2 = gl.split(even)
    b1, b3 = gl.split(odd)
    b0 = gl.convert_layout(gl.reshape(b0, (16, ROWS)), b_layout, assert_trivial=True)
    b1 = gl.convert_layout(gl.reshape(b1, (16, ROWS)), b_layout, assert_trivial=True)
    b2 = gl.convert_layout(gl.reshape(b2, (16, ROWS)), b_layout, assert_trivial=True)
    b3 = gl.convert_layout(gl.reshape(b3, (16, ROWS)), b_layout, assert_trivial=True)
    return b0, b1, b2, b3


@gluon.jit
def _words(words, a_layout: gl.constexpr, MAGIC: gl.constexpr, DTYPE: gl.constexpr):
    """A loop step's words [warp, g, t, s] -> the four MMA steps' A tiles."""
    WARPS: gl.constexpr = words.shape[0]
    words = gl.reshape(words, (WARPS, 8, 4, 2, 2))  # s = 2 * s_hi + s_lo
    even, odd = gl.split(words)  # s_lo = 0, 1
    w0, w2 = gl.split(even)
    w1, w3 = gl.split(odd)
    a0 = _a_operand(w0, MAGIC, DTYPE, a_layout)
    a1 = _a_operand(w1, MAGIC, DTYPE, a_layout)
    a2 = _a_operand(w2, MAGIC, DTYPE, a_layout)
    a3 = _a_operand(w3, MAGIC, DTYPE, a_layout)
    return a0, a1, a2, a3


@gluon.jit
def _apply_group(total, dot, sums, s_ptr, z_ptr, offs_n, mask_n, groups, group,
                 OFFSET: gl.constexpr, ZERO_IS_MIN: gl.constexpr):  # fmt: skip
    """total + this group's scale * (dot - (OFFSET + zero) * sum(x)) (or the min's form)."""
    scale = gl.load(s_ptr + offs_n * groups + group, mask=mask_n, other=0.0)[:, None]
    zero = gl.load(z_ptr + offs_n * groups + group, mask=mask_n, other=0.0)[:, None]
    if ZERO_IS_MIN:
        return total + scale * (dot - OFFSET * sums) + zero * sums
    return total + scale * (dot - (OFFSET + zero) * sums)


@gluon.jit
def _step(words, x, dot, sums, ones, total, step, s_ptr, z_ptr, offs_n, mask_n, groups, zeros,
          a_layout: gl.constexpr, b_layout: gl.constexpr, MAGIC: gl.constexpr,
          OFFSET: gl.constexpr, ZERO_IS_MIN: gl.constexpr, GROUP32: gl.constexpr,
          GROUP_SHIFT: gl.constexpr):  # fmt: skip
    """One loop step's four MMAs (and four for sum(x)) onto dot and sums; groups of 32 and 64
    applied to total here (dot and sums come back zero), larger ones by the caller."""
    DTYPE: gl.constexpr = ones.dtype
    a0, a1, a2, a3 = _words(words, a_layout, MAGIC, DTYPE)
    b0, b1, b2, b3 = _b_operands(x, DTYPE, b_layout)
    dot = mma_v2(a1, b1, mma_v2(a0, b0, dot))
    sums = mma_v2(ones, b1, mma_v2(ones, b0, sums))
    if GROUP32:  # two groups a step: each half on its own
        total = _apply_group(total, dot, sums, s_ptr, z_ptr, offs_n, mask_n, groups, step * 2,
                             OFFSET, ZERO_IS_MIN)  # fmt: skip
        dot = zeros
        sums = zeros
    dot = mma_v2(a3, b3, mma_v2(a2, b2, dot))
    sums = mma_v2(ones, b3, mma_v2(ones, b2, sums))
    if GROUP32:
        total = _apply_group(total, dot, sums, s_ptr, z_ptr, offs_n, mask_n, groups,
                             step * 2 + 1, OFFSET, ZERO_IS_MIN)  # fmt: skip
        dot = zeros
        sums = zeros
    elif GROUP_SHIFT == 0:  # groups of 64: one a step
        total = _apply_group(total, dot, sums, s_ptr, z_ptr, offs_n, mask_n, groups, step,
                             OFFSET, ZERO_IS_MIN)  # fmt: skip
        dot = zeros
        sums = zeros
    return dot, sums, total


@gluon.jit
def _int4_mma_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, part_ptr, counter_ptr,
    M, N, K, stride_xm, stride_ym, stride_wt, groups, steps_per_split,
    ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, SPLIT_K: gl.constexpr,
    HAS_BIAS: gl.constexpr, ZERO_IS_MIN: gl.constexpr, GROUP32: gl.constexpr,
    GROUP_SHIFT: gl.constexpr,
    MAGIC: gl.constexpr, OFFSET: gl.constexpr,
    W_LAYOUT: gl.constexpr, X_LAYOUT: gl.constexpr,
):  # fmt: skip
    BLOCK_N: gl.constexpr = 16 * NUM_WARPS
    DTYPE: gl.constexpr = x_ptr.dtype.element_ty
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[2, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, 8]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    b_layout: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=acc_layout, k_width=2)
    tile = gl.program_id(0)
    row0 = gl.program_id(2) * ROWS

    # This program's words: row tile * NUM_WARPS + warp of the repacked [N_pad / 16, 2K].
    w_offs = ((tile * NUM_WARPS + _index4(NUM_WARPS, 0, W_LAYOUT)) * stride_wt
              + _index4(8, 1, W_LAYOUT) * 16 + _index4(4, 2, W_LAYOUT) * 4
              + _index4(4, 3, W_LAYOUT))  # fmt: skip
    # x as int32 pairs (K and the row stride are even).
    x_pairs = x_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    rows = row0 + _index4(ROWS, 3, X_LAYOUT)
    x_offs = (rows * (stride_xm // 2) + _index4(2, 0, X_LAYOUT) * 16
              + _index4(4, 1, X_LAYOUT) * 4 + _index4(4, 2, X_LAYOUT))  # fmt: skip
    x_mask = rows < M

    step_start = gl.program_id(1) * steps_per_split  # even: two steps an iteration
    step_stop = gl.minimum(step_start + steps_per_split, K // 64)
    offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, gl.SliceLayout(1, acc_layout))
    mask_n = offs_n < N
    ones = gl.full([BLOCK_N, 16], 1.0, DTYPE, a_layout)
    zeros = gl.zeros([BLOCK_N, ROWS], gl.float32, acc_layout)
    total = zeros

    words0 = gl.load(w_ptr + w_offs + step_start * 128)
    words1 = gl.load(w_ptr + w_offs + step_start * 128 + 128)
    x0 = gl.load(x_pairs + x_offs + step_start * 32, mask=x_mask, other=0)
    x1 = gl.load(x_pairs + x_offs + step_start * 32 + 32, mask=x_mask, other=0)
    for step in range(step_start, step_stop, 2):
        # The next two steps' loads go out before these two's arithmetic (the last re-reads).
        following = gl.minimum(step + 2, step_stop - 2)
        next_words0 = gl.load(w_ptr + w_offs + following * 128)
        next_words1 = gl.load(w_ptr + w_offs + following * 128 + 128)
        next_x0 = gl.load(x_pairs + x_offs + following * 32, mask=x_mask, other=0)
        next_x1 = gl.load(x_pairs + x_offs + following * 32 + 32, mask=x_mask, other=0)
        dot, sums, total = _step(words0, x0, zeros, zeros, ones, total, step, s_ptr, z_ptr,
                                 offs_n, mask_n, groups, zeros, a_layout, b_layout, MAGIC,
                                 OFFSET, ZERO_IS_MIN, GROUP32, GROUP_SHIFT)  # fmt: skip
        dot, sums, total = _step(words1, x1, dot, sums, ones, total, step + 1, s_ptr, z_ptr,
                                 offs_n, mask_n, groups, zeros, a_layout, b_layout, MAGIC,
                                 OFFSET, ZERO_IS_MIN, GROUP32, GROUP_SHIFT)  # fmt: skip
        if not GROUP32 and GROUP_SHIFT > 0:  # both steps in one group: applied once
            total = _apply_group(total, dot, sums, s_ptr, z_ptr, offs_n, mask_n, groups,
                                 step >> GROUP_SHIFT, OFFSET, ZERO_IS_MIN)  # fmt: skip
        words0 = next_words0
        words1 = next_words1
        x0 = next_x0
        x1 = next_x1

    offs_m = row0 + gl.arange(0, ROWS, gl.SliceLayout(0, acc_layout))
    out_mask = (offs_m < M)[None, :] & mask_n[:, None]
    out = offs_m[None, :] * N + offs_n[:, None]  # [M, N] partials
    if SPLIT_K > 1:
        gl.store(part_ptr + gl.program_id(1) * (M * N) + out, total, mask=out_mask)
        _barrier()  # every thread's partials stored before the ticket
        taken = gl.atomic_add(counter_ptr + gl.program_id(2) * gl.num_programs(0) + tile, 1,
                              sem="acq_rel", scope="gpu")  # fmt: skip
        last = taken == SPLIT_K - 1
        out_mask = out_mask & last
        total = gl.load(part_ptr + out, mask=out_mask, other=0.0, cache_modifier=".cg")
        for split in gl.static_range(1, SPLIT_K):
            total += gl.load(part_ptr + split * (M * N) + out, mask=out_mask, other=0.0,
                             cache_modifier=".cg")  # fmt: skip
        gl.store(counter_ptr + gl.program_id(2) * gl.num_programs(0) + tile, 0, mask=last)
    if HAS_BIAS:
        total += gl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(gl.float32)[:, None]
    gl.store(y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None],
             total.to(y_ptr.dtype.element_ty), mask=out_mask)  # fmt: skip


def rows_per_program(m: int) -> int:
    """ROWS: x's rows a program takes (the MMA's N, a power of two from 8)."""
    return max(8, triton.next_power_of_2(m))


def split_count(n: int, k: int, row_tiles: int, device: torch.device) -> tuple[int, int]:
    """(loop steps a split, splits): about PROGRAMS_PER_SM programs an SM, at most MAX_SPLIT."""
    tiles = triton.cdiv(n, 16 * NUM_WARPS) * row_tiles
    pairs = k // (2 * K_STEP)  # a split takes whole loop iterations of two steps
    want = max(1, min(MAX_SPLIT, pairs, PROGRAMS_PER_SM * num_sms(device) // tiles))
    per = triton.cdiv(pairs, want)
    return 2 * per, triton.cdiv(pairs, per)


def launch_config(m: int, n: int, k: int, group_size: int, dtype: torch.dtype,
                  device: torch.device) -> tuple[tuple[int, int, int], int, dict]:  # fmt: skip
    """(grid, loop steps a split, the kernel's constexprs and launch options)."""
    rows = rows_per_program(m)
    row_tiles = triton.cdiv(m, rows)
    per, splits = split_count(n, k, row_tiles, device)
    magic, offset = _MAGIC[dtype]
    meta = {
        "ROWS": rows,
        "NUM_WARPS": NUM_WARPS,
        "SPLIT_K": splits,
        "GROUP32": group_size == 32,
        "GROUP_SHIFT": group_shift(k, group_size),
        "MAGIC": magic,
        "OFFSET": offset,
        "W_LAYOUT": words_layout(NUM_WARPS),
        "X_LAYOUT": x_layout(rows, NUM_WARPS),
        "num_warps": NUM_WARPS,
    }
    return (triton.cdiv(n, 16 * NUM_WARPS), splits, row_tiles), per, meta


def int4_linear_mma(
    x: torch.Tensor,  # [M, K] bf16 / fp16, M <= MAX_ROWS
    repacked: torch.Tensor,  # [N_pad / 16, 2K] int32: int4_mma_layout.repack of the codes
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32
    bias: torch.Tensor | None = None,  # [N]
    zero_is_min: bool = False,
) -> torch.Tensor:  # [M, N] in x's dtype
    m, k = x.shape
    n, groups = scales.shape
    group_size = k // groups
    assert repacked.shape == (repacked_rows(n) // N_TILE, 2 * k)
    assert N_ALIGN % (16 * NUM_WARPS) == 0  # whole tiles: the weight loads take no mask
    assert m <= MAX_ROWS and group_shift(k, group_size) is not None
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    grid, per, meta = launch_config(m, n, k, group_size, x.dtype, x.device)
    part = counters = y
    if meta["SPLIT_K"] > 1:
        part = split_k.partials(meta["SPLIT_K"], m, n, device=x.device)
        counters = split_k.counters(x.device)
    _int4_mma_kernel[grid](
        x, repacked, scales, zeros, bias if bias is not None else scales, y, part, counters,
        m, n, k, x.stride(0), y.stride(0), repacked.stride(0), groups, per,
        HAS_BIAS=bias is not None, ZERO_IS_MIN=zero_is_min, **meta,
    )  # fmt: skip
    return y
