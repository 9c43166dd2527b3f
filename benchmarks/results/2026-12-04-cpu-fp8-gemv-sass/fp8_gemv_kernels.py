"""A candidate one-row FP8 projection on the CUDA cores, measured against the engine's float8
small-batch kernel (benchmarks/fp8_gemv_sweep.py) and not used by the engine.

Why: at batch-1 decode every projection is a weight stream, and the engine's float8 kernel
(small_batch_linear, one row put in a tl.dot tile padded to 16 rows) reads its weight at 1.8-3.3
TB/s on the H200 against ~4.25 for a copy (o_proj 9.1 us for 16.8 MB, down 20.6 for 58.7, gate_up
~35 for 117.4: benchmarks/results/2026-12-01-h200-final-wave/). Every float8 weight byte goes
through shared memory to reach the tensor core, and a float8 tile costs the loop what a bf16 tile
of the same bytes costs (benchmarks/results/2026-12-01-h200-fp8-small-batch/). An earlier
CUDA-core variant (commit 696716a, reverted) was slower still, but it summed each tile over K
inside the loop (a cross-thread reduction per step, for one row's [BLOCK_N] results) and ran one
program per SM.

Here the weight goes from HBM to registers only, 16 bytes a thread, widened to fp32 and
multiplied by the row's float8 values (exact products, as on the tensor cores), into a
[BLOCK_N, BLOCK_K] fp32 accumulator that is summed over K once, after the loop. The loop does no
cross-thread work at all. PREFETCH loads the next tile before this one's arithmetic (by hand: a
load that feeds no tl.dot is not pipelined), the last trip re-reading its own tile (an L1/L2 hit)
instead of masking. Split-K (kiln's split_k.py: partials, a ticket, the last program sums in
split order) gives the projections with few output tiles more programs. A dynamic input scale
needs the row's absmax: one unrolled pass over the row (from L2) before the stream; a static
scale needs none.

The arithmetic is reference.fp8_linear's (and GATED: reference.silu_and_mul after it), summed in
another order; tests/test_fp8_gemv_candidate.py checks it under the interpreter.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.kernels.triton import split_k
from kiln.kernels.triton.fp8_gemm import scaled_to_e4m3


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,  # [K] in the model dtype: the one row
    w_ptr,  # [N, K] float8 e4m3, contiguous (GATED: [2N, K], the gate rows then the up rows)
    w_scale_ptr,  # [N] (GATED: [2N]) fp32 per-row weight scales
    in_scale_ptr,  # [] fp32 static activation scale, read when STATIC
    out_ptr,  # [N] in the model dtype: x @ w.T, or GATED silu(x @ gate.T) * (x @ up.T)
    q_ptr,  # [K] float8 scratch: the row quantized, when STAGE_X
    part_ptr,  # [SPLIT_K, 1 + GATED, N] fp32 partial sums, when SPLIT_K > 1
    counter_ptr,  # split_k.counters, when SPLIT_K > 1
    N,
    K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,  # a whole number of BLOCK_K steps (split_k.k_per_split)
    STATIC: tl.constexpr,
    GATED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    STATS_BLOCK: tl.constexpr,  # K per load of the absmax pass (unrolled over all of K)
    SPLIT_K: tl.constexpr,
    PREFETCH: tl.constexpr,
    STAGE_X: tl.constexpr,  # quantize the row's K range once into q_ptr, read back in the loop
    INTERPRETED: tl.constexpr,
    FP8_MAX: tl.constexpr = 448.0,
    MIN_SCALE: tl.constexpr = 1e-12,
):
    tl.static_assert(K % BLOCK_K == 0, "the stream takes whole BLOCK_K steps")
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    ks = tl.arange(0, BLOCK_K)
    if STATIC:
        scale = tl.load(in_scale_ptr)
    else:
        absmax = tl.zeros([STATS_BLOCK], dtype=tl.float32)
        for k in tl.static_range(0, K, STATS_BLOCK):  # unrolled: every load issued at once
            offs = k + tl.arange(0, STATS_BLOCK)
            chunk = tl.load(x_ptr + offs, mask=offs < K, other=0.0)
            absmax = tl.maximum(absmax, tl.abs(chunk.to(tl.float32)))
        scale = tl.maximum(tl.math.div_rn(tl.max(absmax, 0), FP8_MAX), MIN_SCALE)
    inv_scale = tl.math.div_rn(1.0, scale)
    k_start = 0
    k_stop = K
    if SPLIT_K > 1:
        k_start = tl.program_id(1) * K_PER_SPLIT
        k_stop = tl.minimum(k_start + K_PER_SPLIT, K)
    if STAGE_X:
        # Every program writes the same float8 values (a function of x and the scale alone),
        # so programs that share K positions race only to write equal bytes. Read back in the
        # loop as bytes, the row arrives in the weight tile's own layout: no conversion through
        # shared memory (and no barrier) a trip.
        for k in range(k_start, k_stop, BLOCK_K):
            xk = tl.load(x_ptr + k + ks).to(tl.float32)
            q = scaled_to_e4m3(xk, scale, inv_scale, not STATIC, FP8_MAX, INTERPRETED)
            tl.store(q_ptr + k + ks, q.to(tl.float8e4nv))
        tl.debug_barrier()  # this program's stores before its own loads
    # Rows past N read row N - 1 (no mask in the loop); their sums are never stored.
    w_rows = w_ptr + tl.minimum(cols, N - 1)[:, None].to(tl.int64) * K + ks[None, :]
    up_rows = w_rows + N.to(tl.int64) * K
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    if PREFETCH:
        w = tl.load(w_rows + k_start)
        w_up = w
        if GATED:
            w_up = tl.load(up_rows + k_start)
    for k in range(k_start, k_stop, BLOCK_K):
        if PREFETCH:  # the next trip's tile first (the last trip re-reads its own)
            nxt = tl.minimum(k + BLOCK_K, k_stop - BLOCK_K)
            w_cur, w_up_cur = w, w_up
            w = tl.load(w_rows + nxt)
            w_up = w
            if GATED:
                w_up = tl.load(up_rows + nxt)
        else:
            w_cur = tl.load(w_rows + k)
            w_up_cur = w_cur
            if GATED:
                w_up_cur = tl.load(up_rows + k)
        if STAGE_X:
            q = tl.load(q_ptr + k + ks).to(tl.float32)[None, :]
        else:
            xk = tl.load(x_ptr + k + ks).to(tl.float32)
            q = scaled_to_e4m3(xk, scale, inv_scale, not STATIC, FP8_MAX, INTERPRETED)
            q = q.to(tl.float8e4nv).to(tl.float32)[None, :]
        acc += w_cur.to(tl.float32) * q
        if GATED:
            acc_up += w_up_cur.to(tl.float32) * q
    total = tl.sum(acc, 1) * scale
    total_up = tl.sum(acc_up, 1) * scale
    if SPLIT_K > 1:
        num_accs: tl.constexpr = 2 if GATED else 1
        mine = part_ptr + tl.program_id(1) * (num_accs * N)
        tl.store(mine + cols, total, mask=col_mask)
        if GATED:
            tl.store(mine + N + cols, total_up, mask=col_mask)
        is_last = split_k.arrive(counter_ptr, tl.program_id(0), cols, SPLIT_K)
        col_mask = col_mask & is_last
        total = split_k.sum_partials(part_ptr, cols, col_mask, num_accs * N, SPLIT_K)
        if GATED:
            total_up = split_k.sum_partials(part_ptr + N, cols, col_mask, num_accs * N, SPLIT_K)
    total *= tl.load(w_scale_ptr + cols, mask=col_mask, other=0.0)
    if GATED:
        total_up *= tl.load(w_scale_ptr + N + cols, mask=col_mask, other=0.0)
        # Rounded as reference.silu_and_mul over the unfused projection's output.
        dtype = out_ptr.dtype.element_ty
        gate = total.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        total = act * total_up.to(dtype).to(tl.float32)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=col_mask)


def fp8_gemv(
    x: torch.Tensor,  # [1, K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8 e4m3 (gated: [2N, K])
    weight_scale: torch.Tensor,  # [N] (gated: [2N]) fp32
    input_scale: torch.Tensor | None,  # [] fp32 static; None: dynamic (the row's absmax)
    gated: bool = False,
    block_n: int = 16,
    block_k: int = 512,
    num_warps: int = 4,
    split: int = 1,
    prefetch: bool = True,
    stats_block: int = 2048,
    num_stages: int = 1,  # >1 lets Triton's pipeliner try the loads too
    stage_x: bool = False,
) -> torch.Tensor:  # [1, N] (gated: [1, N / 2 of the weight's rows])
    """reference.fp8_linear of one row (gated: reference.silu_and_mul of it)."""
    rows, k = weight.shape
    n = rows // 2 if gated else rows
    assert x.shape == (1, k) and x.is_contiguous() and weight.is_contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    per_split, num_splits = split_k.k_per_split(k, split, block_k)
    num_tiles = triton.cdiv(n, block_n)
    part = counters = out
    staged = torch.empty(k if stage_x else 1, dtype=torch.float8_e4m3fn, device=x.device)
    if num_splits > 1:
        part = split_k.partials(num_splits, 2 if gated else 1, n, device=x.device)
        counters = split_k.counters(x.device)
    _fp8_gemv_kernel[(num_tiles, num_splits)](
        x,
        weight,
        weight_scale,
        input_scale if input_scale is not None else weight_scale,
        out,
        staged,
        part,
        counters,
        n,
        K=k,
        K_PER_SPLIT=per_split,
        STATIC=input_scale is not None,
        GATED=gated,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        STATS_BLOCK=min(stats_block, triton.next_power_of_2(k)),
        SPLIT_K=num_splits,
        PREFETCH=prefetch,
        STAGE_X=stage_x,
        INTERPRETED=x.device.type != "cuda",
        FP8_MAX=FP8_E4M3_MAX,
        MIN_SCALE=FP8_MIN_SCALE,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
