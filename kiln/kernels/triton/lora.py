"""LoRA's shrink and expand for a step that mixes adapters (twins of reference.lora_shrink and
reference.lora_expand): the punica idea (one launch over the step's packed tokens, each token
multiplied by its own adapter slot's weights), laid out for CUDA graphs.

Layout: tiles of BLOCK_M rows in the step's own order, and inside a tile a loop over the distinct
slots its rows hold (the largest slot left, its rows masked in, then marked done). A tile of one
request's prefill is one pass; a decode tile that mixes adapters makes one pass per adapter, each
reading that adapter's weight tile once for all its rows. The bytes, at 256 decode rows with 8
adapters of rank 16 on Llama-3.1-8B (x and out bf16):
- per-row gather (BGMV, each row its own weight): every row reads its slot's whole A and B, so
  shrink reads 256 x 393 KB = 100 MB for qkv (A [48, 4096]) and expand 256 x 917 KB = 235 MB of B
  for gate_up ([28672, 16]): as many bytes as the base layer's weight (mostly from L2, but L2 is
  not free either).
- here (64-row tiles, 4 tiles, each holding all 8 adapters): A and B once per (tile, adapter):
  12.6 MB of A for qkv, 29 MB of B for gate_up, from L2; from HBM each adapter once (3.1 MB of A,
  7.3 MB of B), and x, y and out's rows once each (out's read-modify-write, 29 MB for gate_up, is
  what expand costs anyway).
- sorted by slot (vLLM's SGMV: token indices grouped by adapter): each adapter once per 64 of its
  own rows, but the grouping is a sort per step that this signature (token_slots only) would
  have to redo in every layer, and rows are gathered and scattered through the permutation.
Decode tiles are few, so a launch also cuts the slots into classes (slot % LoraPlan.slot_groups),
one program each, when the tiles alone would leave SMs idle (BGMV's parallelism at 1-8 rows: each
program one adapter), and the shrink cuts its reduction (hidden) over several programs
per tile, reduced in the same kernel (split_k.py: no memset, no second launch, a fixed sum order).

CUDA graphs: every launch's grid, tiles and workspace depend only on shapes; which slots a tile
holds is decided on the device (the loop's trip count), never on the host. Rows whose slot is -1
take no pass: the shrink writes zeros for them, the expand leaves their output alone. Slots must be
below lora_a's / lora_b's first dimension (not checked: that would read token_slots on the host).
Tile sizes are first choices, not measured on a GPU yet (benchmarks/kernels_gpu.py has the rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.triton import split_k
from kiln.kernels.triton._device import dot_precision, num_sms

MAX_SLICES = 3  # fused qkv; gate_up is 2, the other projections 1


@dataclass(frozen=True)
class LoraPlan:
    """One launch's tiles: rows per tile, columns (expand) or hidden (shrink) per step, slot
    classes, and (shrink) programs cutting the hidden dimension."""

    block_m: int
    block_n: int
    slot_groups: int
    split_k: int = 1


@triton.jit
def _tile_slots(slots_ptr, offs_m, T, groups):
    """This program's rows' slots, -1 where the row is past T or in another program's class;
    and the rows it stores in the shrink (its class, slot -1 rows in class 0)."""
    row_ok = offs_m < T
    slots = tl.load(slots_ptr + offs_m, mask=row_ok, other=-1)
    group = tl.program_id(2)
    mine = row_ok & (tl.where(slots >= 0, slots % groups, 0) == group)
    return tl.where(mine, slots, -1), mine


# A step's token count (and the slot classes it brings) changes with every prefill mix: Triton's
# specialisation on an argument's value (1, multiples of 16) would compile a variant each.
@triton.jit(do_not_specialize=["T", "groups"])
def _lora_shrink_kernel(
    x_ptr, a_ptr, slots_ptr, y_ptr, part_ptr, counter_ptr, T, H, K, h_per_split, groups,
    stride_xt, stride_xh, stride_as, stride_ak, stride_ah, stride_yt, stride_yk,
    PRECISION: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # 64-bit tile bases, 32-bit offsets inside the tile (fewer registers per element).
    local = tl.arange(0, BLOCK_M)
    x_ptr += m0.to(tl.int64) * stride_xt
    y_ptr += m0.to(tl.int64) * stride_yt
    part_ptr += m0.to(tl.int64) * K + tl.program_id(1).to(tl.int64) * T * K
    h_start, h_stop = split_k.k_range(H, h_per_split, SPLIT_K)
    todo, mine = _tile_slots(slots_ptr, offs_m, T, groups)
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    slot = tl.max(todo, axis=0)
    while slot >= 0:  # one pass per distinct slot of the tile, largest first
        hit = todo == slot
        a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_k[None, :] * stride_ak
        for h0 in range(h_start, h_stop, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < h_stop
            x = tl.load(x_ptr + local[:, None] * stride_xt + offs_h[None, :] * stride_xh,
                        mask=hit[:, None] & h_ok[None, :], other=0.0)  # fmt: skip
            a = tl.load(a_base + offs_h[:, None] * stride_ah,
                        mask=h_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
            acc += tl.dot(x, a.to(x.dtype), input_precision=PRECISION)
        todo = tl.where(hit, -1, todo)
        slot = tl.max(todo, axis=0)
    mask = mine[:, None] & (offs_k < K)[None, :]
    y_offs = local[:, None] * stride_yt + offs_k[None, :] * stride_yk
    if SPLIT_K == 1:
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        part = local[:, None] * K + offs_k[None, :]  # the workspace [SPLIT_K, T, K]
        tl.store(part_ptr + part, acc, mask=mask)
        tile = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        mask = mask & split_k.arrive(counter_ptr, tile, part, SPLIT_K)
        part_ptr -= tl.program_id(1).to(tl.int64) * T * K  # split 0's, for the sum
        acc = split_k.sum_partials(part_ptr, part, mask, T * K, SPLIT_K)
        tl.store(y_ptr + y_offs, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "groups"])
def _lora_expand_kernel(
    out_ptr, y_ptr, b_ptr, slots_ptr, T, N, rank, bound1, bound2, groups,
    stride_ot, stride_on, stride_yt, stride_yk, stride_bs, stride_bn, stride_br,
    PRECISION: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    local = tl.arange(0, BLOCK_M)
    out_ptr += m0.to(tl.int64) * stride_ot
    y_ptr += m0.to(tl.int64) * stride_yt
    col_ok = offs_n < N
    r_ok = offs_r < rank
    col_slice = (offs_n >= bound1).to(tl.int32) + (offs_n >= bound2).to(tl.int32)
    todo, _ = _tile_slots(slots_ptr, offs_m, T, groups)
    mask = (todo >= 0)[:, None] & col_ok[None, :]
    # The base output's tile first: its load does not wait on the adapters' passes.
    out_ptrs = out_ptr + local[:, None] * stride_ot + offs_n[None, :] * stride_on
    base = tl.load(out_ptrs, mask=mask, other=0.0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    slot = tl.max(todo, axis=0)
    while slot >= 0:
        hit = todo == slot
        b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + offs_r[:, None] * stride_br
                    + offs_n[None, :] * stride_bn,
                    mask=r_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        for i in tl.static_range(SLICES):
            # Slice i's columns read y's i-th rank-wide block; a tile may straddle two slices.
            lo = 0 if i == 0 else (bound1 if i == 1 else bound2)
            hi = bound1 if i == 0 else (bound2 if i == 1 else N)
            if (n0 < hi) & (n0 + BLOCK_N > lo):
                y = tl.load(y_ptr + local[:, None] * stride_yt
                            + (i * rank + offs_r)[None, :] * stride_yk,
                            mask=hit[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
                b_i = tl.where((col_slice == i)[None, :], b, 0.0).to(y.dtype)
                acc += tl.dot(y, b_i, input_precision=PRECISION)
        todo = tl.where(hit, -1, todo)
        slot = tl.max(todo, axis=0)
    tl.store(out_ptrs, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


def _block_m(num_tokens: int) -> int:
    # 16 is tl.dot's smallest; 64 rows share each adapter tile's read four times as well as 16.
    return min(64, max(16, triton.next_power_of_2(num_tokens)))


def _slot_groups(programs: int, num_slots: int, device: torch.device) -> int:
    """Slot classes that bring a launch to ~4 programs per SM (each class its own program)."""
    return max(1, min(num_slots, triton.cdiv(4 * num_sms(device), max(programs, 1))))


def shrink_plan(num_tokens: int, hidden: int, rank_cols: int, num_slots: int,
                device: torch.device) -> LoraPlan:  # fmt: skip
    block_k = max(16, triton.next_power_of_2(rank_cols))
    # The fp32 accumulator [BLOCK_M, BLOCK_K] at <= 4K values and 64-deep hidden steps (32 past
    # 128 columns): sm_90 builds of every rank x slices up to 64 x 3 then keep to registers.
    block_m = min(_block_m(num_tokens), max(16, 4096 // block_k))
    block_h = 64 if block_k <= 128 else 32
    tiles = triton.cdiv(num_tokens, block_m)
    # Up to 32 splits: the last program of a tile reads every split's partials back.
    want = max(1, min(32, triton.cdiv(2 * num_sms(device), tiles)))
    want = 1 << (want.bit_length() - 1)  # powers of two: few SPLIT_K variants to compile
    _, splits = split_k.k_per_split(hidden, want, block_h)
    return LoraPlan(block_m, block_h, _slot_groups(tiles * splits, num_slots, device), splits)


def expand_plan(num_tokens: int, n_out: int, num_slots: int, device: torch.device) -> LoraPlan:
    block_m = _block_m(num_tokens)
    block_n = 64
    programs = triton.cdiv(num_tokens, block_m) * triton.cdiv(n_out, block_n)
    return LoraPlan(block_m, block_n, _slot_groups(programs, num_slots, device))


def lora_shrink(
    x: torch.Tensor,  # [T, hidden_in]
    lora_a: torch.Tensor,  # [slots, slices * rank, hidden_in]: each slot's stacked A matrices
    token_slots: torch.Tensor,  # [T] int32: each token's adapter slot, -1 for none
) -> torch.Tensor:  # [T, slices * rank] in x's dtype, zero where the slot is -1
    return shrink_with_plan(x, lora_a, token_slots, None)


def lora_expand(
    out: torch.Tensor,  # [T, n_out] the base layer's output, added to in place (any strides)
    y: torch.Tensor,  # [T, slices * rank]: lora_shrink's result
    lora_b: torch.Tensor,  # [slots, n_out, rank]: each slot's B rows, the scaling folded in
    token_slots: torch.Tensor,  # [T] int32: each token's adapter slot, -1 for none
    slice_bounds: tuple[int, ...],  # column boundaries of the fused slices: (0, q, q+k, ..., n_out)
) -> None:
    expand_with_plan(out, y, lora_b, token_slots, slice_bounds, None)


def shrink_with_plan(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    plan: LoraPlan | None,  # None: shrink_plan's choice (tests force each path)
) -> torch.Tensor:
    t, h = x.shape
    num_slots, k, h_a = lora_a.shape
    if h_a != h or token_slots.shape != (t,):
        raise ValueError(f"lora_shrink: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
                         f"token_slots {tuple(token_slots.shape)}")  # fmt: skip
    y = torch.empty(t, k, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    plan = plan or shrink_plan(t, h, k, num_slots, x.device)
    per_split, splits = split_k.k_per_split(h, plan.split_k, plan.block_n)
    tiles = triton.cdiv(t, plan.block_m)
    part = counters = y
    if splits > 1:
        assert tiles * plan.slot_groups <= split_k.MAX_TILES, "lora_shrink: too many tiles"
        part = split_k.partials(splits, t, k, device=x.device)
        counters = split_k.counters(x.device)
    _lora_shrink_kernel[(tiles, splits, plan.slot_groups)](
        x, lora_a, token_slots, y, part, counters, t, h, k, per_split, plan.slot_groups,
        x.stride(0), x.stride(1), *lora_a.stride(), *y.stride(),
        PRECISION=dot_precision(x.dtype), SPLIT_K=splits, BLOCK_M=plan.block_m,
        BLOCK_H=plan.block_n, BLOCK_K=max(16, triton.next_power_of_2(k)),
    )  # fmt: skip
    return y


def expand_with_plan(
    out: torch.Tensor,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_bounds: tuple[int, ...],
    plan: LoraPlan | None,  # None: expand_plan's choice (tests force each path)
) -> None:
    t, n = out.shape
    num_slots, n_b, rank = lora_b.shape
    slices = len(slice_bounds) - 1
    if not 1 <= slices <= MAX_SLICES or slice_bounds[0] != 0 or slice_bounds[-1] != n:
        raise ValueError(f"lora_expand: slice_bounds {slice_bounds} for {n} output columns "
                         f"(1 to {MAX_SLICES} slices from 0 to n_out)")  # fmt: skip
    if n_b != n or y.shape != (t, slices * rank) or token_slots.shape != (t,):
        shapes = (tuple(v.shape) for v in (out, y, lora_b, token_slots))
        raise ValueError("lora_expand: out {}, y {}, lora_b {}, token_slots {}".format(*shapes))
    if t == 0:
        return
    plan = plan or expand_plan(t, n, num_slots, out.device)
    inner = [*slice_bounds[1:-1], n, n][:2]  # the boundaries between slices, n where fewer
    grid = (triton.cdiv(n, plan.block_n), triton.cdiv(t, plan.block_m), plan.slot_groups)
    _lora_expand_kernel[grid](
        out, y, lora_b, token_slots, t, n, rank, inner[0], inner[1], plan.slot_groups,
        *out.stride(), *y.stride(), *lora_b.stride(),
        PRECISION=dot_precision(y.dtype), SLICES=slices, BLOCK_M=plan.block_m,
        BLOCK_N=plan.block_n, BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )  # fmt: skip
