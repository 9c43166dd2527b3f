"""The routed experts for a few tokens (decode; twin of reference.fused_moe_decode): GEMV
launches that read only the chosen experts' weights, with no sort by expert and no padding to a
GEMM row block. The first runs one program per (token, top-k slot, column tile) of the gate_up
projection and applies SiLU-and-mul to its gate and up halves in registers; the second one per
(token, column tile) of the down projection, looping over the token's k slots, scaling each
expert's product by its routing weight and summing in fp32 in slot order (no atomics) into the
output. Column tiles are narrow enough that batch 1 launches hundreds of programs, and each
program's loop is software-pipelined (weight tiles, and the next slot's expert id, stream into
shared memory stages ahead of the sums), so every SM keeps weight bytes in flight. A variant
of the down projection (tile candidates ending in 0) runs one program per (token, slot, column
tile, chunk of a long reduction) into fp32 rows and sums them in a third launch: more programs,
one more launch.

Weights are the model dtype's or float8 e4m3 (widened in registers; weight-only) with a scale
per expert ([E]), per expert and output channel ([E, N]) or per 128x128 block ([E, N, K / 128]:
each row's scale of each 128 inputs, loaded once a chunk and multiplied into that chunk's
partial sums, so the loop streams per-channel float8's bytes: BLOCK_SCALED).
Constexpr variants: gpt-oss's expert biases and clamped SwiGLU; fused_moe_decode_routed's
gate_up launch also takes the residual stream and the router's logits, RMS-norms the row inside
its loop (the norm's scale, one scalar a row, multiplies the sums at the end, so block scales
compose with it) and routes its token itself (moe_router.route_row, a few hundred flops a
program), writing the ids and weights the down launch reads; the down launch may add a shared
expert's sigmoid-gated output (Qwen2-MoE). A batch-1 MoE block is then its router's GEMV (the
add + norm inside: small_batch_linear) and these two launches. Everything is on the device with
shapes from the token count alone: no host sync, so a CUDA graph captures it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._device import num_sms
from kiln.kernels.triton.moe_router import route_row
from kiln.kernels.triton.silu_mul import _silu_f32

# (gate_up BLOCK_N, BLOCK_K, num_warps, down BLOCK_N, BLOCK_K, num_warps, pipeline stages, down
# variant: 1 one program per (token, column tile) looping over the k slots into the output, 0
# one per (token, slot, column tile, K chunk) into fp32 rows that a third launch sums). The
# GPU's BLOCK_N is picked by the launch's size (_block_n), its BLOCK_K by the weights' width
# (512 bytes of a row a step). Untuned: benchmarks/kernels_gpu.py --only moe sweeps
# DECODE_TILE_CANDIDATES. The interpreter's cost grows with the tiles.
Tiles = tuple[int, int, int, int, int, int, int, int]
_INTERPRETER_TILES: Tiles = (8, 16, 4, 8, 16, 4, 1, 1)
_ROW_BYTES, _NUM_WARPS, _NUM_STAGES = 512, 4, 3
_INT4_BLOCK_K = 512  # INT4 codes a step: 256 bytes of packed words a row
_MAX_K_CHUNK = 2048  # the split down GEMV's reduction per program, at most
_COLUMN_TILES = (32, 16, 8)  # widest first: fewer, longer programs while there are enough
DECODE_TILE_CANDIDATES: tuple[Tiles, ...] = tuple(
    (*tiles, fused_sum)
    for fused_sum in (1, 0)
    for tiles in (
        (16, 256, 4, 16, 256, 4, 3),
        (16, 512, 4, 8, 512, 4, 3),
        (8, 512, 4, 8, 512, 4, 4),
        (16, 256, 4, 32, 256, 4, 4),
        (32, 256, 8, 32, 256, 8, 3),
        (16, 512, 8, 16, 512, 8, 2),
    )
)


def _block_n(rows: int, n: int, device: torch.device) -> int:
    """The widest column tile that still gives every SM two programs (rows x n / BLOCK_N)."""
    target = 2 * num_sms(device)
    for block in _COLUMN_TILES:
        if rows * triton.cdiv(n, block) >= target:
            return block
    return _COLUMN_TILES[-1]


@triton.jit
def _block_scaled_dot(w, xk, scale_ptr, expert, cols, col_mask, k0, K, stride_se, stride_sn,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """[len(cols)] fp32: the widened codes w ([BLOCK_N, BLOCK_K], inputs k0 ..) times xk, each
    128 inputs' partial sums times their row's block scale. One scale a row and 128-input
    chunk ([BLOCK_N, BLOCK_K / 128]), not one a weight: a per-weight scale tile streamed 4 bytes
    a code through the pipeline's shared memory, 4x the weights' bytes."""
    CHUNK: tl.constexpr = min(BLOCK_K, 128)  # BLOCK_K, a power of two, divides 128 or k0 does
    parts = tl.sum(tl.reshape(w * xk[None, :], (BLOCK_N, BLOCK_K // CHUNK, CHUNK)), axis=2)
    starts = k0 + tl.arange(0, BLOCK_K // CHUNK) * CHUNK
    rows = scale_ptr + expert * stride_se + cols[:, None].to(tl.int64) * stride_sn
    mask = col_mask[:, None] & (starts < K)[None, :]
    scales = tl.load(rows + (starts // 128)[None, :], mask=mask, other=0.0)
    return tl.sum(parts * scales, axis=1)


@triton.jit
def _int4_dot(rows, scale_ptr, zero_ptr, expert, cols, col_mask, k0, K, xk, stride_se,
              stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """[len(cols)] fp32: the rows' INT4 weights of inputs k0 .. k0 + BLOCK_K times xk
    ([BLOCK_K] fp32). kiln's layout: input k at bits 4 (k % 8) of word k // 8 of its row, its
    group's scale and zero k // GROUP (a multiple of 8, so one a word): each word and scale is
    loaded once and its 8 codes unpacked in registers as a [rows, words, 8] tile."""
    words_k = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    mask = col_mask[:, None] & (words_k < K // 8)[None, :]
    words = tl.load(rows + words_k[None, :], mask=mask, other=0)
    at = expert * stride_se + cols[:, None].to(tl.int64) * stride_sn
    at += (words_k * 8 // GROUP)[None, :]
    scale = tl.load(scale_ptr + at, mask=mask, other=0.0)
    zero = tl.load(zero_ptr + at, mask=mask, other=0.0)
    shifts = tl.arange(0, 8) * 4
    codes = ((words[:, :, None] >> shifts[None, None, :]) & 0xF).to(tl.float32)
    w = (codes - zero[:, :, None]) * scale[:, :, None]
    x3 = tl.reshape(xk, (BLOCK_K // 8, 8))
    return tl.sum(tl.sum(w * x3[None, :, :], axis=2), axis=1)


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # [num_tokens, K]: the input (with NORMED the residual stream, normed here)
    norm_ptr,  # [K]: the RMSNorm's weight (read with NORMED only)
    logits_ptr,  # [num_tokens, num_experts] router logits (read with ROUTED only)
    w_ptr,  # [num_experts, 2 * N, K]: gate rows, then up rows
    scale_ptr,  # [E], [E, 2 * N] or [E, 2 * N, K / 128] fp32 (with INT4: [E, 2 * N, K / GROUP])
    zero_ptr,  # [E, 2 * N, K / GROUP] fp32: INT4 zero points (read with INT4 only)
    bias_ptr,  # [num_experts, 2 * N] (read with HAS_BIAS only)
    ids_ptr,  # [num_tokens * top_k] int: each pair's expert (written with ROUTED)
    weights_ptr,  # [num_tokens * top_k] fp32 routing weights (written with ROUTED)
    out_ptr,  # [num_tokens * top_k, N]: the activation in x's dtype
    top_k,
    N,
    K,
    num_experts,
    eps,
    alpha,  # the clamped SwiGLU's (with SWIGLU only)
    limit,
    stride_x,
    stride_logits,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,  # 0 for a per-expert scale
    stride_be,
    stride_out,
    SCALED: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,  # with SCALED: a scale per row and 128 inputs (a chunk's sums)
    INT4: tl.constexpr,  # w: int32 words of 8 codes [E, 2 * N, K / 8], dequantized here
    GROUP: tl.constexpr,  # with INT4: inputs per scale and zero
    NORMED: tl.constexpr,  # x is the residual stream: rms_norm it here (dot * rsqrt at the end)
    ROUTED: tl.constexpr,  # pick the pair's expert from the logits here (moe_router.route_row)
    TOP_K: tl.constexpr,  # with ROUTED: top_k as a constant
    RENORMALIZE: tl.constexpr,
    ROUND: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_TOP_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SWIGLU: tl.constexpr,  # gpt-oss's clamped SwiGLU in place of SiLU(gate) * up
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    token = (pair // top_k).to(tl.int64)
    if ROUTED:  # every column tile routes its token again: a few hundred flops, no launch
        chosen, chosen_ids = route_row(
            logits_ptr + token * stride_logits, num_experts, TOP_K, RENORMALIZE, ROUND,
            BLOCK_E, BLOCK_TOP_K,
        )  # fmt: skip
        lane = tl.arange(0, BLOCK_TOP_K) == pair % top_k
        expert = tl.sum(tl.where(lane, chosen_ids, 0), axis=0)
        if tl.program_id(1) == 0:  # the down kernel's ids and weights
            tl.store(ids_ptr + pair, expert)
            tl.store(weights_ptr + pair, tl.sum(tl.where(lane, chosen, 0.0), axis=0))
    else:
        expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + N * stride_wn
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    squares = tl.zeros((BLOCK_K,), dtype=tl.float32)
    # Pipelined: the next stages' weight tiles stream into shared memory while one is summed.
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xk = tl.load(x_ptr + token * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        if NORMED:  # RMSNorm's scale is one scalar a row: applied to the sums after the loop
            squares += xk * xk
            xk = xk * tl.load(norm_ptr + ks, mask=k_mask, other=0.0).to(tl.float32)
        mask = col_mask[:, None] & k_mask[None, :]
        if INT4:  # only this pair's expert's words are read, a quarter of 16-bit's bytes
            gate += _int4_dot(gate_rows, scale_ptr, zero_ptr, expert, cols, col_mask, k0, K, xk,
                              stride_se, stride_sn, GROUP, BLOCK_K)  # fmt: skip
            up += _int4_dot(up_rows, scale_ptr, zero_ptr, expert, cols + N, col_mask, k0, K, xk,
                            stride_se, stride_sn, GROUP, BLOCK_K)  # fmt: skip
        else:
            g = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            u = tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if BLOCK_SCALED:  # the norm's rsqrt, one scalar a row, still commutes with these
                gate += _block_scaled_dot(g, xk, scale_ptr, expert, cols, col_mask, k0, K,
                                          stride_se, stride_sn, BLOCK_N, BLOCK_K)  # fmt: skip
                up += _block_scaled_dot(u, xk, scale_ptr, expert, cols + N, col_mask, k0, K,
                                        stride_se, stride_sn, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                gate += tl.sum(g * xk[None, :], axis=1)
                up += tl.sum(u * xk[None, :], axis=1)
    if NORMED:
        rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
        gate *= rstd
        up *= rstd
    if SCALED and not BLOCK_SCALED:
        scales = scale_ptr + expert * stride_se
        gate *= tl.load(scales + cols * stride_sn, mask=col_mask, other=0.0)
        up *= tl.load(scales + (cols + N) * stride_sn, mask=col_mask, other=0.0)
    if HAS_BIAS:
        biases = bias_ptr + expert * stride_be
        gate += tl.load(biases + cols, mask=col_mask, other=0.0).to(tl.float32)
        up += tl.load(biases + N + cols, mask=col_mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # Rounded as the reference's gate_up then activation are: each to the model dtype.
    gate = gate.to(dtype).to(tl.float32)
    up = up.to(dtype).to(tl.float32)
    if SWIGLU:  # reference.clamped_swiglu, in fp32 and rounded once
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        act = _silu_f32(gate, INTERPRETED).to(dtype).to(tl.float32) * up
    out = out_ptr + pair.to(tl.int64) * stride_out + cols
    tl.store(out, act.to(dtype), mask=col_mask)


@triton.jit
def _down_kernel(
    h_ptr,  # [num_pairs, K]: the activations of each (token, slot) pair
    w_ptr,  # [num_experts, N, K]
    scale_ptr,  # [E], [E, N] or [E, N, K / 128] fp32 (with INT4: [E, N, K / GROUP])
    zero_ptr,  # [E, N, K / GROUP] fp32 (read with INT4 only)
    ids_ptr,  # [num_pairs] int
    weights_ptr,  # [num_pairs] fp32 routing weights
    bias_ptr,  # [num_experts, N] (read with HAS_BIAS only; added by the first chunk)
    out_ptr,  # [num_pairs * num_splits, N] fp32: each pair's weighted down product, by K chunk
    N,
    K,
    K_CHUNK,  # a multiple of BLOCK_K: the reduction's split (Mixtral's 14336: several programs)
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_out,
    SCALED: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    INT4: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pair = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(2)
    col_mask = cols < N
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    down = tl.zeros((BLOCK_N,), dtype=tl.float32)
    k_start = split * K_CHUNK
    k_end = tl.minimum(k_start + K_CHUNK, K)
    for k0 in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        hk = tl.load(h_ptr + pair * stride_h + ks, mask=k_mask, other=0.0).to(tl.float32)
        mask = col_mask[:, None] & k_mask[None, :]
        if INT4:
            down += _int4_dot(rows, scale_ptr, zero_ptr, expert, cols, col_mask, k0, K, hk,
                              stride_se, stride_sn, GROUP, BLOCK_K)  # fmt: skip
        else:
            w = tl.load(rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if BLOCK_SCALED:
                down += _block_scaled_dot(w, hk, scale_ptr, expert, cols, col_mask, k0, K,
                                          stride_se, stride_sn, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                down += tl.sum(w * hk[None, :], axis=1)
    if SCALED and not BLOCK_SCALED:
        down *= tl.load(scale_ptr + expert * stride_se + cols * stride_sn, mask=col_mask, other=0.0)
    if HAS_BIAS:
        first = (split == 0).to(tl.float32)
        bias = tl.load(bias_ptr + expert * stride_be + cols, mask=col_mask, other=0.0)
        down += first * bias.to(tl.float32)
    down *= tl.load(weights_ptr + pair)
    out_row = pair * tl.num_programs(2) + split
    tl.store(out_ptr + out_row * stride_out + cols, down, mask=col_mask)


@triton.jit
def _down_sum_kernel(
    h_ptr,  # [num_tokens * top_k, K]: the activations of each (token, slot) pair
    w_ptr,  # [num_experts, N, K]
    scale_ptr,  # [E], [E, N] or [E, N, K / 128] fp32 (with INT4: [E, N, K / GROUP])
    zero_ptr,  # [E, N, K / GROUP] fp32 (read with INT4 only)
    ids_ptr,  # [num_tokens * top_k] int
    weights_ptr,  # [num_tokens * top_k] fp32 routing weights
    bias_ptr,  # [num_experts, N] (read with HAS_BIAS only)
    shared_ptr,  # [num_tokens, N]: the shared expert's output (read with SHARED only)
    shared_gate_ptr,  # [num_tokens] its gate's logits (read with SHARED only)
    out_ptr,  # [num_tokens, N]
    top_k,
    N,
    K,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_be,
    stride_shared,
    stride_shared_gate,
    stride_out,
    SCALED: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
    INT4: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SHARED: tl.constexpr,  # Qwen2-MoE: + sigmoid(shared gate) * shared expert
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    k_steps = tl.cdiv(K, BLOCK_K)
    total = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # One loop over (slot, K step), so the pipeline streams the next slot's expert (its id
    # loaded stages ahead too) while this one's last steps are summed.
    for i in tl.range(0, top_k * k_steps, num_stages=NUM_STAGES):
        slot = i // k_steps
        k0 = (i - slot * k_steps) * BLOCK_K
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        pair = token * top_k + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        hk = tl.load(h_ptr + pair * stride_h + ks, mask=k_mask, other=0.0).to(tl.float32)
        rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        mask = col_mask[:, None] & k_mask[None, :]
        if INT4:
            part = _int4_dot(rows, scale_ptr, zero_ptr, expert, cols, col_mask, k0, K, hk,
                             stride_se, stride_sn, GROUP, BLOCK_K)  # fmt: skip
        else:
            w = tl.load(rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
            if BLOCK_SCALED:
                part = _block_scaled_dot(w, hk, scale_ptr, expert, cols, col_mask, k0, K,
                                         stride_se, stride_sn, BLOCK_N, BLOCK_K)  # fmt: skip
            else:
                part = tl.sum(w * hk[None, :], axis=1)
        if SCALED and not BLOCK_SCALED:
            scales = scale_ptr + expert * stride_se + cols * stride_sn
            part *= tl.load(scales, mask=col_mask, other=0.0)
        if HAS_BIAS:  # once a slot: on its last K step
            last = (i - slot * k_steps == k_steps - 1).to(tl.float32)
            bias = tl.load(bias_ptr + expert * stride_be + cols, mask=col_mask, other=0.0)
            part += last * bias.to(tl.float32)
        total += part * tl.load(weights_ptr + pair)
    if SHARED:
        total = _add_shared(total, shared_ptr, shared_gate_ptr, token, cols, col_mask,
                            stride_shared, stride_shared_gate)  # fmt: skip
    out = out_ptr + token * stride_out + cols
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _add_shared(total, shared_ptr, shared_gate_ptr, token, cols, col_mask, stride_shared,
                stride_shared_gate):  # fmt: skip
    """total + sigmoid(the token's shared gate logit) * its shared expert's output, in fp32."""
    gate = tl.load(shared_gate_ptr + token * stride_shared_gate).to(tl.float32)
    shared = tl.load(shared_ptr + token * stride_shared + cols, mask=col_mask, other=0.0)
    return total + shared.to(tl.float32) / (1.0 + tl.exp(-gate))


@triton.jit
def _sum_slots_kernel(
    rows_ptr,  # [num_tokens * rows_per_token, N] fp32
    shared_ptr,  # as _down_sum_kernel's (read with SHARED only)
    shared_gate_ptr,
    out_ptr,  # [num_tokens, N]
    rows_per_token,  # top_k x the down GEMV's K splits
    N,
    stride_shared,
    stride_shared_gate,
    SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(rows_per_token):  # in slot order, as the reference adds them
        total += tl.load(rows_ptr + (token * rows_per_token + row) * N + cols, mask=mask, other=0.0)
    if SHARED:
        total = _add_shared(total, shared_ptr, shared_gate_ptr, token, cols, mask, stride_shared,
                            stride_shared_gate)  # fmt: skip
    tl.store(out_ptr + token * N + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def _scale_args(scale: torch.Tensor | None, like: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the scale tensor, its expert stride, its channel stride: 0 for one scale per expert);
    block scales [E, N, K / 128] contiguous in their last dimension."""
    if scale is None:
        return like, 0, 0
    if scale.dim() == 1:
        return scale, scale.stride(0), 0
    if scale.dim() == 3:
        scale = scale.float().contiguous()
    return scale, scale.stride(0), scale.stride(1)


def _block_scaled(scale: torch.Tensor | None) -> bool:
    """Whether `scale` is one per row and 128 inputs ([E, N, K / 128]: the BLOCK_SCALED
    variants)."""
    return scale is not None and scale.dim() == 3


def fused_moe_decode(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's [gate; up] rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]: each expert's down projection
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32: each chosen expert's weight
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int: the chosen experts
    w13_scale: torch.Tensor | None = None,  # [E], [E, 2 * inter] or [E, 2 * inter, KB] fp32
    w2_scale: torch.Tensor | None = None,  # [E], [E, hidden] or [E, hidden, KB] fp32
    w13_bias: torch.Tensor | None = None,  # [E, 2 * inter]: gpt-oss's expert biases
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    swiglu: tuple[float, float] | None = None,  # gpt-oss's clamped SwiGLU (alpha, limit)
) -> torch.Tensor:  # [num_tokens, hidden]
    return fused_moe_decode_tiled(
        x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, None,
        w13_bias=w13_bias, w2_bias=w2_bias, swiglu=swiglu,
    )  # fmt: skip


def fused_moe_int4_decode(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden / 8] int32: [gate; up] rows' codes
    w2: torch.Tensor,  # [num_experts, hidden, inter / 8] int32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    w13_scale: torch.Tensor,  # [E, 2 * inter, hidden / group] fp32
    w2_scale: torch.Tensor,  # [E, hidden, inter / group] fp32
    w13_zero: torch.Tensor,  # as w13_scale, in code units
    w2_zero: torch.Tensor,  # as w2_scale
) -> torch.Tensor:  # [num_tokens, hidden]
    """fused_moe_decode on W4A16 experts (reference.fused_moe_int4_decode): the GEMVs read the
    chosen experts' packed words and dequantize them in registers (the INT4 variants)."""
    return fused_moe_decode_tiled(
        x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, None, int4=(w13_zero, w2_zero)
    )


def fused_moe_decode_routed(
    x: torch.Tensor,  # [num_tokens, hidden]: the residual stream
    norm_weight: torch.Tensor | None,  # [hidden]: the RMSNorm before the experts; None: none
    eps: float,
    router_logits: torch.Tensor,  # [num_tokens, num_experts] in the model dtype
    top_k: int,
    renormalize: bool,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,
    int4_zeros: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:  # [num_tokens, hidden]
    """See reference.fused_moe_decode_routed: the norm and the routing inside the gate_up
    launch (two launches in all, where rms_norm, moe_route and the experts took four)."""
    if router_logits.dtype != x.dtype:
        raise ValueError(
            f"router logits in {router_logits.dtype}, the stream in {x.dtype}: the kernel "
            "rounds the routing weights to the logits' dtype, the model's"
        )
    num_tokens = x.shape[0]
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    return fused_moe_decode_tiled(
        x, w13, w2, weights, ids, w13_scale, w2_scale, None, w13_bias=w13_bias,
        w2_bias=w2_bias, swiglu=swiglu, route=(router_logits.contiguous(), renormalize),
        norm=None if norm_weight is None else (norm_weight, eps), shared=shared, int4=int4_zeros,
    )  # fmt: skip


def fused_moe_decode_tiled(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    tiles: Tiles | None,  # see _INTERPRETER_TILES; None: the device's
    *,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    route: tuple[torch.Tensor, bool] | None = None,  # (router logits, renormalize): the
    # gate_up launch routes each token and writes topk_weights and topk_ids (shapes only given)
    norm: tuple[torch.Tensor, float] | None = None,  # (norm weight, eps): x is rms_norm'd here
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, hidden] shared expert's
    # output, [T, 1] its gate's logits): added as sigmoid(gate) * output in the last launch
    int4: tuple[torch.Tensor, torch.Tensor] | None = None,  # INT4 experts' (w13, w2) zero
    # points: w13 / w2 are packed codes, w13_scale / w2_scale their group scales
) -> torch.Tensor:
    """fused_moe_decode at given tiles (tests and the kernel benchmark sweep them)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    hidden, inter = w2.shape[1], w2.shape[2] * (8 if int4 is not None else 1)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    if route is None:
        ids, weights = ids.contiguous(), weights.float().contiguous()
    interpreted = x.device.type != "cuda"
    if tiles is None:
        if interpreted:
            tiles = _INTERPRETER_TILES
        else:
            block_k = _INT4_BLOCK_K if int4 is not None else _ROW_BYTES // w13.element_size()
            tiles = (
                _block_n(num_pairs, inter, x.device), block_k, _NUM_WARPS,
                _block_n(num_tokens, hidden, x.device), block_k, _NUM_WARPS, _NUM_STAGES, 1,
            )  # fmt: skip
    n1, k1, warps1, n2, k2, warps2, stages, fused_sum = tiles
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    s13, s13_e, s13_n = _scale_args(w13_scale, weights)
    z13, z2 = (s13, s13) if int4 is None else (int4[0].float().contiguous(), int4[1])
    group13 = hidden // s13.shape[-1] if int4 is not None else 1
    scaled13 = w13_scale is not None and int4 is None
    logits, renormalize = route if route is not None else (x, False)
    norm_weight, eps = norm if norm is not None else (x, 0.0)
    alpha, limit = swiglu if swiglu is not None else (0.0, 0.0)
    b13 = w13_bias if w13_bias is not None else x
    num_experts = logits.shape[1] if route is not None else 1
    _gate_up_act_kernel[(num_pairs, triton.cdiv(inter, n1))](
        x, norm_weight, logits, w13, s13, z13, b13, ids, weights, act, top_k, inter, hidden,
        num_experts, float(eps), float(alpha), float(limit), x.stride(0), logits.stride(0),
        w13.stride(0), w13.stride(1), s13_e, s13_n, b13.stride(0), act.stride(0),
        SCALED=scaled13, BLOCK_SCALED=scaled13 and _block_scaled(w13_scale), INT4=int4 is not None,
        GROUP=group13, NORMED=norm is not None, ROUTED=route is not None,
        TOP_K=top_k, RENORMALIZE=renormalize, ROUND=logits.dtype == x.dtype,
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_TOP_K=triton.next_power_of_2(top_k),
        HAS_BIAS=w13_bias is not None, SWIGLU=swiglu is not None, INTERPRETED=interpreted,
        BLOCK_N=n1, BLOCK_K=k1, NUM_STAGES=stages, num_warps=warps1,
    )  # fmt: skip
    s2, s2_e, s2_n = _scale_args(w2_scale, weights)
    if int4 is not None:
        z2 = int4[1].float().contiguous()
    group2 = inter // s2.shape[-1] if int4 is not None else 1
    scaled2 = w2_scale is not None and int4 is None
    quant2 = dict(SCALED=scaled2, BLOCK_SCALED=scaled2 and _block_scaled(w2_scale),
                  INT4=int4 is not None, GROUP=group2)  # fmt: skip
    b2 = w2_bias if w2_bias is not None else x
    shared_out, shared_gate = shared if shared is not None else (x, x)
    shared_strides = (shared_out.stride(0), shared_gate.stride(0))
    if fused_sum:
        _down_sum_kernel[(num_tokens, triton.cdiv(hidden, n2))](
            act, w2, s2, z2, ids, weights, b2, shared_out, shared_gate, out, top_k, hidden, inter,
            act.stride(0), w2.stride(0), w2.stride(1), s2_e, s2_n, b2.stride(0),
            *shared_strides, out.stride(0), **quant2, HAS_BIAS=w2_bias is not None,
            SHARED=shared is not None,
            BLOCK_N=n2, BLOCK_K=k2, NUM_STAGES=stages, num_warps=warps2,
        )  # fmt: skip
        return out
    # A long reduction (Mixtral's 14336) split into chunks of a few serial loads a program.
    chunk = triton.cdiv(triton.cdiv(inter, triton.cdiv(inter, _MAX_K_CHUNK)), k2) * k2
    num_splits = triton.cdiv(inter, chunk)
    down = torch.empty(num_pairs * num_splits, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(num_pairs, triton.cdiv(hidden, n2), num_splits)](
        act, w2, s2, z2, ids, weights, b2, down, hidden, inter, chunk, act.stride(0), w2.stride(0),
        w2.stride(1), s2_e, s2_n, b2.stride(0), down.stride(0), **quant2,
        HAS_BIAS=w2_bias is not None, BLOCK_N=n2,
        BLOCK_K=k2, NUM_STAGES=stages, num_warps=warps2,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](
        down, shared_out, shared_gate, out, top_k * num_splits, hidden, *shared_strides,
        SHARED=shared is not None, BLOCK=block,
    )  # fmt: skip
    return out
