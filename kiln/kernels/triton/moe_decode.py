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
each row's scale of each 128 inputs, multiplied into the widened codes). Everything is on the
device with shapes from the token count alone: no host sync, so a CUDA graph captures it."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._device import num_sms
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
def _block_scales(scale_ptr, expert, cols, ks, mask, stride_se, stride_sn):
    """[len(cols), len(ks)] fp32: each weight's block scale (its row's, of its 128 inputs)."""
    rows = scale_ptr + expert * stride_se + cols[:, None].to(tl.int64) * stride_sn
    return tl.load(rows + (ks // 128)[None, :], mask=mask, other=0.0)


@triton.jit
def _gate_up_act_kernel(
    x_ptr,  # [num_tokens, K]
    w_ptr,  # [num_experts, 2 * N, K]: gate rows, then up rows
    scale_ptr,  # [E], [E, 2 * N] or [E, 2 * N, K / 128] fp32 (read with SCALED only)
    ids_ptr,  # [num_tokens * top_k] int: each pair's expert
    out_ptr,  # [num_tokens * top_k, N]: silu(gate) * up in x's dtype
    top_k,
    N,
    K,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,  # 0 for a per-expert scale
    stride_out,
    SCALED: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,  # with SCALED: a scale per row and 128 inputs, on the codes
    INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    pair = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    token = (pair // top_k).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    gate_rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + N * stride_wn
    gate = tl.zeros((BLOCK_N,), dtype=tl.float32)
    up = tl.zeros((BLOCK_N,), dtype=tl.float32)
    # Pipelined: the next stages' weight tiles stream into shared memory while one is summed.
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        xk = tl.load(x_ptr + token * stride_x + ks, mask=k_mask, other=0.0).to(tl.float32)
        mask = col_mask[:, None] & k_mask[None, :]
        g = tl.load(gate_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            g *= _block_scales(scale_ptr, expert, cols, ks, mask, stride_se, stride_sn)
            u *= _block_scales(scale_ptr, expert, cols + N, ks, mask, stride_se, stride_sn)
        gate += tl.sum(g * xk[None, :], axis=1)
        up += tl.sum(u * xk[None, :], axis=1)
    if SCALED and not BLOCK_SCALED:
        scales = scale_ptr + expert * stride_se
        gate *= tl.load(scales + cols * stride_sn, mask=col_mask, other=0.0)
        up *= tl.load(scales + (cols + N) * stride_sn, mask=col_mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # Rounded as the reference's gate_up then silu_and_mul are: each to the model dtype.
    gate = gate.to(dtype)
    up = up.to(dtype).to(tl.float32)
    act = _silu_f32(gate.to(tl.float32), INTERPRETED).to(dtype).to(tl.float32)
    out = out_ptr + pair.to(tl.int64) * stride_out + cols
    tl.store(out, (act * up).to(dtype), mask=col_mask)


@triton.jit
def _down_kernel(
    h_ptr,  # [num_pairs, K]: the activations of each (token, slot) pair
    w_ptr,  # [num_experts, N, K]
    scale_ptr,  # [num_experts] or [num_experts, N] fp32 (read with SCALED only)
    ids_ptr,  # [num_pairs] int
    weights_ptr,  # [num_pairs] fp32 routing weights
    out_ptr,  # [num_pairs * num_splits, N] fp32: each pair's weighted down product, by K chunk
    N,
    K,
    K_CHUNK,  # a multiple of BLOCK_K: the reduction's split (Mixtral's 14336: several programs)
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    SCALED: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
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
        w = tl.load(rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            w *= _block_scales(scale_ptr, expert, cols, ks, mask, stride_se, stride_sn)
        down += tl.sum(w * hk[None, :], axis=1)
    if SCALED and not BLOCK_SCALED:
        down *= tl.load(scale_ptr + expert * stride_se + cols * stride_sn, mask=col_mask, other=0.0)
    down *= tl.load(weights_ptr + pair)
    out_row = pair * tl.num_programs(2) + split
    tl.store(out_ptr + out_row * stride_out + cols, down, mask=col_mask)


@triton.jit
def _down_sum_kernel(
    h_ptr,  # [num_tokens * top_k, K]: the activations of each (token, slot) pair
    w_ptr,  # [num_experts, N, K]
    scale_ptr,  # [num_experts] or [num_experts, N] fp32 (read with SCALED only)
    ids_ptr,  # [num_tokens * top_k] int
    weights_ptr,  # [num_tokens * top_k] fp32 routing weights
    out_ptr,  # [num_tokens, N]
    top_k,
    N,
    K,
    stride_h,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    stride_out,
    SCALED: tl.constexpr,
    BLOCK_SCALED: tl.constexpr,
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
        ks = (i - slot * k_steps) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        pair = token * top_k + slot
        expert = tl.load(ids_ptr + pair).to(tl.int64)
        hk = tl.load(h_ptr + pair * stride_h + ks, mask=k_mask, other=0.0).to(tl.float32)
        rows = w_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
        mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(rows + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        if BLOCK_SCALED:
            w *= _block_scales(scale_ptr, expert, cols, ks, mask, stride_se, stride_sn)
        part = tl.sum(w * hk[None, :], axis=1)
        if SCALED and not BLOCK_SCALED:
            scales = scale_ptr + expert * stride_se + cols * stride_sn
            part *= tl.load(scales, mask=col_mask, other=0.0)
        total += part * tl.load(weights_ptr + pair)
    out = out_ptr + token * stride_out + cols
    tl.store(out, total.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _sum_slots_kernel(
    rows_ptr,  # [num_tokens * rows_per_token, N] fp32
    out_ptr,  # [num_tokens, N]
    rows_per_token,  # top_k x the down GEMV's K splits
    N,
    BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(rows_per_token):  # in slot order, as the reference adds them
        total += tl.load(rows_ptr + (token * rows_per_token + row) * N + cols, mask=mask, other=0.0)
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


def fused_moe_decode(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's [gate; up] rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]: each expert's down projection
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32: each chosen expert's weight
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int: the chosen experts
    w13_scale: torch.Tensor | None = None,  # [E] or [E, 2 * inter] fp32: float8 w13's scales
    w2_scale: torch.Tensor | None = None,  # [E] or [E, hidden] fp32: float8 w2's scales
) -> torch.Tensor:  # [num_tokens, hidden]
    return fused_moe_decode_tiled(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, None)


def fused_moe_decode_tiled(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    tiles: Tiles | None,  # see _INTERPRETER_TILES; None: the device's
) -> torch.Tensor:
    """fused_moe_decode at given tiles (tests and the kernel benchmark sweep them)."""
    num_tokens, top_k = topk_ids.shape
    num_pairs = num_tokens * top_k
    hidden, inter = w2.shape[1], w2.shape[2]
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).float().contiguous()
    interpreted = x.device.type != "cuda"
    if tiles is None:
        if interpreted:
            tiles = _INTERPRETER_TILES
        else:
            block_k = _ROW_BYTES // w13.element_size()
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
    _gate_up_act_kernel[(num_pairs, triton.cdiv(inter, n1))](
        x, w13, s13, ids, act, top_k, inter, hidden, x.stride(0), w13.stride(0), w13.stride(1),
        s13_e, s13_n, act.stride(0), SCALED=w13_scale is not None,
        BLOCK_SCALED=w13_scale is not None and w13_scale.dim() == 3, INTERPRETED=interpreted,
        BLOCK_N=n1, BLOCK_K=k1, NUM_STAGES=stages, num_warps=warps1,
    )  # fmt: skip
    s2, s2_e, s2_n = _scale_args(w2_scale, weights)
    if fused_sum:
        _down_sum_kernel[(num_tokens, triton.cdiv(hidden, n2))](
            act, w2, s2, ids, weights, out, top_k, hidden, inter, act.stride(0), w2.stride(0),
            w2.stride(1), s2_e, s2_n, out.stride(0), SCALED=w2_scale is not None,
            BLOCK_SCALED=w2_scale is not None and w2_scale.dim() == 3,
            BLOCK_N=n2, BLOCK_K=k2, NUM_STAGES=stages, num_warps=warps2,
        )  # fmt: skip
        return out
    # A long reduction (Mixtral's 14336) split into chunks of a few serial loads a program.
    chunk = triton.cdiv(triton.cdiv(inter, triton.cdiv(inter, _MAX_K_CHUNK)), k2) * k2
    num_splits = triton.cdiv(inter, chunk)
    down = torch.empty(num_pairs * num_splits, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(num_pairs, triton.cdiv(hidden, n2), num_splits)](
        act, w2, s2, ids, weights, down, hidden, inter, chunk, act.stride(0), w2.stride(0),
        w2.stride(1), s2_e, s2_n, down.stride(0), SCALED=w2_scale is not None,
            BLOCK_SCALED=w2_scale is not None and w2_scale.dim() == 3,
        BLOCK_N=n2, BLOCK_K=k2, NUM_STAGES=stages, num_warps=warps2,
    )  # fmt: skip
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_slots_kernel[(num_tokens, triton.cdiv(hidden, block))](
        down, out, top_k * num_splits, hidden, BLOCK=block
    )
    return out
