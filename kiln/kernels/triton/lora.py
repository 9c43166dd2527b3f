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

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kiln.kernels.triton import split_k
from kiln.kernels.triton._device import dot_precision, num_sms

MAX_SLICES = 3  # fused qkv; gate_up is 2, the other projections 1
MAX_SPLITS = 32  # the shrink's most programs per tile over the hidden dimension


@dataclass(frozen=True)
class LoraPlan:
    """One launch's tiles: rows per tile, columns (expand) or hidden (shrink) per step, slot
    classes, and (shrink) programs cutting the hidden dimension."""

    block_m: int
    block_n: int
    slot_groups: int
    split_k: int = 1


@triton.jit
def _tile_slots(slots_ptr, order_ptr, offs_m, T, groups):
    """The tile's rows (positions offs_m of the step's slot order) and their slots, -1 where
    the position is past T or the row in another program's class; and the rows it stores in
    the shrink (its class, slot -1 rows in class 0)."""
    row_ok = offs_m < T
    rows = tl.load(order_ptr + offs_m, mask=row_ok, other=0)
    slots = tl.load(slots_ptr + rows, mask=row_ok, other=-1)
    group = tl.program_id(2)
    mine = row_ok & (tl.where(slots >= 0, slots % groups, 0) == group)
    return rows, tl.where(mine, slots, -1), mine


@triton.jit
def _arrive(counter_ptr, tile, like, splits):
    """split_k.arrive with the split count a run-time value (one compiled variant for all)."""
    tl.debug_barrier()
    taken = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu")
    tl.store(counter_ptr + tile, 0, mask=taken == splits - 1)
    return (tl.zeros_like(like) + taken) == splits - 1


@triton.jit
def _sum_partials(part_ptr, offsets, mask, split_stride, splits, MAX_SPLITS: tl.constexpr):
    """split_k.sum_partials over a run-time split count, in split order: unrolled to
    MAX_SPLITS, the loads past `splits` predicated off, so they are all in flight at once."""
    # fp32 whatever part_ptr is: an unsplit launch passes the output as a stand-in, and both
    # branches of a run-time `splits` test compile, so their accumulators must agree.
    total = tl.load(part_ptr + offsets, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    for split in tl.static_range(1, MAX_SPLITS):
        live = mask & ((tl.zeros_like(offsets) + split) < splits)
        total += tl.load(part_ptr + split * split_stride + offsets, mask=live, other=0.0,
                         cache_modifier=".cg")  # fmt: skip
    return total


# Every argument that follows the step's shape (token count, slot classes, split count and
# width) is kept out of Triton's specialisation: a value of 1 or a multiple of 16 would compile
# a variant each; the constexprs take two values (BLOCK_M, see _block_m), both run at start-up.
SHRINK_NOT_SPECIALIZED = ("T", "h_per_split", "splits", "groups")
EXPAND_NOT_SPECIALIZED = ("T", "groups")


@triton.jit(do_not_specialize=SHRINK_NOT_SPECIALIZED)
def _lora_shrink_kernel(
    x_ptr, x_scale_ptr, a_ptr, slots_ptr, order_ptr, y_ptr, part_ptr, counter_ptr, T, H, K,
    h_per_split,
    splits, groups, stride_xt, stride_xh, stride_as, stride_ak, stride_ah, stride_yt, stride_yk,
    PRECISION: tl.constexpr, X_SCALE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, MAX_SPLITS: tl.constexpr,
):  # fmt: skip
    m0 = tl.program_id(0) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    local = tl.arange(0, BLOCK_M)
    part_ptr += m0.to(tl.int64) * K + tl.program_id(1).to(tl.int64) * T * K
    h_start = tl.program_id(1) * h_per_split  # one split: h_per_split covers H
    h_stop = tl.minimum(h_start + h_per_split, H)
    rows, todo, mine = _tile_slots(slots_ptr, order_ptr, offs_m, T, groups)
    x_rows = x_ptr + rows.to(tl.int64) * stride_xt  # [BLOCK_M] row starts, 64-bit
    acc = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    slot = tl.max(todo, axis=0)
    while slot >= 0:  # one pass per distinct slot of the tile, largest first
        hit = todo == slot
        a_base = a_ptr + slot.to(tl.int64) * stride_as + offs_k[None, :] * stride_ak
        for h0 in range(h_start, h_stop, BLOCK_H):
            offs_h = h0 + tl.arange(0, BLOCK_H)
            h_ok = offs_h < h_stop
            x = tl.load(x_rows[:, None] + offs_h[None, :] * stride_xh,
                        mask=hit[:, None] & h_ok[None, :], other=0.0)  # fmt: skip
            a = tl.load(a_base + offs_h[:, None] * stride_ah,
                        mask=h_ok[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
            # A float8 input (what the base's float8 GEMM read) widens to the adapter's dtype.
            acc += tl.dot(x.to(a.dtype), a, input_precision=PRECISION)
        todo = tl.where(hit, -1, todo)
        slot = tl.max(todo, axis=0)
    if X_SCALE == 1:  # one scale for every row: the products are linear in it
        acc *= tl.load(x_scale_ptr)
    elif X_SCALE == 2:  # a scale per row
        acc *= tl.load(x_scale_ptr + rows, mask=offs_m < T, other=0.0)[:, None]
    mask = mine[:, None] & (offs_k < K)[None, :]
    y_dst = y_ptr + rows.to(tl.int64)[:, None] * stride_yt + offs_k[None, :] * stride_yk
    if splits == 1:
        tl.store(y_dst, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        part = local[:, None] * K + offs_k[None, :]  # the workspace [splits, T, K]
        tl.store(part_ptr + part, acc, mask=mask)
        tile = tl.program_id(0) * tl.num_programs(2) + tl.program_id(2)
        mask = mask & _arrive(counter_ptr, tile, part, splits)
        part_ptr -= tl.program_id(1).to(tl.int64) * T * K  # split 0's, for the sum
        acc = _sum_partials(part_ptr, part, mask, T * K, splits, MAX_SPLITS)
        tl.store(y_dst, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=EXPAND_NOT_SPECIALIZED)
def _lora_expand_kernel(
    out_ptr, y_ptr, b_ptr, slots_ptr, order_ptr, T, N, rank, bound1, bound2, groups,
    stride_ot, stride_on, stride_yt, stride_yk, stride_bs, stride_bn, stride_br,
    PRECISION: tl.constexpr, SLICES: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    m0 = tl.program_id(1) * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    col_ok = offs_n < N
    r_ok = offs_r < rank
    col_slice = (offs_n >= bound1).to(tl.int32) + (offs_n >= bound2).to(tl.int32)
    rows, todo, _ = _tile_slots(slots_ptr, order_ptr, offs_m, T, groups)
    rows = rows.to(tl.int64)
    y_rows = y_ptr + rows * stride_yt  # [BLOCK_M] row starts
    mask = (todo >= 0)[:, None] & col_ok[None, :]
    # The base output's tile first: its load does not wait on the adapters' passes.
    out_ptrs = out_ptr + rows[:, None] * stride_ot + offs_n[None, :] * stride_on
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
                y = tl.load(y_rows[:, None] + (i * rank + offs_r)[None, :] * stride_yk,
                            mask=hit[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
                b_i = tl.where((col_slice == i)[None, :], b, 0.0).to(y.dtype)
                acc += tl.dot(y, b_i, input_precision=PRECISION)
        todo = tl.where(hit, -1, todo)
        slot = tl.max(todo, axis=0)
    tl.store(out_ptrs, (base.to(tl.float32) + acc).to(out_ptr.dtype.element_ty), mask=mask)


# Host arithmetic in plain Python: triton.cdiv and next_power_of_2 are jit functions, ~5-15 us
# each called from Python, and a launch took eight of them.
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _pow2_at_least_16(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


@functools.cache
def _per_split(hidden: int, splits: int, block: int) -> tuple[int, int]:
    """split_k.k_per_split, cached."""
    return split_k.k_per_split(hidden, splits, block)


def _block_m(num_tokens: int) -> int:
    # Two tile heights only (a third would be one more variant to compile): 16, tl.dot's
    # smallest, for decode batches up to 16; 64 rows above, sharing each adapter tile's read.
    return 16 if num_tokens <= 16 else 64


def _slot_groups(programs: int, num_slots: int, num_tokens: int, device: torch.device) -> int:
    """Slot classes that bring a launch to ~4 programs per SM (each class its own program); no
    more than the tokens, which hold at most that many adapters (at batch 1, seven of eight
    classes' programs found no row and only cost their launch)."""
    return max(1, min(num_slots, num_tokens, _cdiv(4 * num_sms(device), max(programs, 1))))


@functools.lru_cache(maxsize=4096)
def shrink_plan(num_tokens: int, hidden: int, rank_cols: int, num_slots: int,
                device: torch.device) -> LoraPlan:  # fmt: skip
    """(Cached: an eager step asks once per LoRA layer, each with the same shapes.)"""
    block_k = _pow2_at_least_16(rank_cols)
    # The fp32 accumulator [BLOCK_M, BLOCK_K] at <= 4K values and 64-deep hidden steps (32 past
    # 128 columns): sm_90 builds of every rank x slices up to 64 x 3 then keep to registers.
    block_m = min(_block_m(num_tokens), max(16, 4096 // block_k))
    block_h = 64 if block_k <= 128 else 32
    tiles = _cdiv(num_tokens, block_m)
    # Up to 32 splits (a run-time count: any number, no variant each): the last program of a
    # tile reads every split's partials back.
    want = max(1, min(MAX_SPLITS, _cdiv(2 * num_sms(device), tiles)))
    _, splits = _per_split(hidden, want, block_h)
    return LoraPlan(
        block_m, block_h, _slot_groups(tiles * splits, num_slots, num_tokens, device), splits
    )


@functools.lru_cache(maxsize=4096)
def expand_plan(num_tokens: int, n_out: int, num_slots: int, device: torch.device) -> LoraPlan:
    block_m = _block_m(num_tokens)
    block_n = 64
    programs = _cdiv(num_tokens, block_m) * _cdiv(n_out, block_n)
    return LoraPlan(block_m, block_n, _slot_groups(programs, num_slots, num_tokens, device))


def lora_shrink(
    x: torch.Tensor,  # [T, hidden_in]: the model dtype, or float8 e4m3 with x_scale
    lora_a: torch.Tensor,  # [slots, slices * rank, hidden_in]: each slot's stacked A matrices
    token_slots: torch.Tensor,  # [T] int32: each token's adapter slot, -1 for none
    x_scale: torch.Tensor | None = None,  # [] / [1] or [T, 1] fp32: a float8 x's scale(s)
    token_order: torch.Tensor | None = None,  # [T] int32: the rows grouped by slot; None: as is
) -> torch.Tensor:  # [T, slices * rank] in lora_a's dtype, zero where the slot is -1
    return shrink_with_plan(x, lora_a, token_slots, None, x_scale, token_order)


def lora_expand(
    out: torch.Tensor,  # [T, n_out] the base layer's output, added to in place (any strides)
    y: torch.Tensor,  # [T, slices * rank]: lora_shrink's result
    lora_b: torch.Tensor,  # [slots, n_out, rank]: each slot's B rows, the scaling folded in
    token_slots: torch.Tensor,  # [T] int32: each token's adapter slot, -1 for none
    slice_bounds: tuple[int, ...],  # column boundaries of the fused slices: (0, q, q+k, ..., n_out)
    token_order: torch.Tensor | None = None,  # [T] int32: the rows grouped by slot; None: as is
) -> None:
    expand_with_plan(out, y, lora_b, token_slots, slice_bounds, None, token_order)


_identity_orders: dict[torch.device, torch.Tensor] = {}


def _order(token_order: torch.Tensor | None, t: int, device: torch.device) -> torch.Tensor:
    """The step's row order, or the rows as they are (made outside CUDA graph capture: the
    LoRA layers always pass theirs)."""
    if token_order is not None:
        if token_order.shape != (t,):
            raise ValueError(f"lora: token_order {tuple(token_order.shape)} for {t} rows")
        return token_order
    iota = _identity_orders.get(device)
    if iota is None or iota.shape[0] < t:
        iota = torch.arange(max(t, 4096), dtype=torch.int32, device=device)
        _identity_orders[device] = iota
    return iota[:t]


@dataclass(frozen=True)
class Launch:
    """One kernel launch as its arguments: what specialises it (tests/kernels reads them to
    check that a step's shape never asks for a new compiled variant)."""

    grid: tuple[int, int, int]
    args: tuple
    constexprs: dict


def shrink_launch(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    y: torch.Tensor,
    plan: LoraPlan,
    x_scale: torch.Tensor | None,
    token_order: torch.Tensor,
) -> Launch:
    """The shrink's launch for `plan` (y: its [T, K] output)."""
    t, h = x.shape
    k = lora_a.shape[1]
    per_split, splits = _per_split(h, plan.split_k, plan.block_n)
    tiles = _cdiv(t, plan.block_m)
    part = counters = y
    assert splits <= MAX_SPLITS, f"lora_shrink: {splits} splits, at most {MAX_SPLITS}"
    if splits > 1:
        assert tiles * plan.slot_groups <= split_k.MAX_TILES, "lora_shrink: too many tiles"
        part = split_k.partials(splits, t, k, device=x.device)
        counters = split_k.counters(x.device)
    mode = 0 if x_scale is None else (2 if x_scale.dim() == 2 else 1)  # [T, 1], or [] / [1]
    scale = y if x_scale is None else x_scale.reshape(-1)  # absent: a tensor never read
    return Launch(
        (tiles, splits, plan.slot_groups),
        (x, scale, lora_a, token_slots, token_order, y, part, counters, t, h, k, per_split, splits,
         plan.slot_groups, x.stride(0), x.stride(1), *lora_a.stride(), *y.stride()),
        dict(PRECISION=dot_precision(lora_a.dtype), X_SCALE=mode, BLOCK_M=plan.block_m,
             BLOCK_H=plan.block_n, BLOCK_K=_pow2_at_least_16(k), MAX_SPLITS=MAX_SPLITS),
    )  # fmt: skip


def shrink_with_plan(
    x: torch.Tensor,
    lora_a: torch.Tensor,
    token_slots: torch.Tensor,
    plan: LoraPlan | None,  # None: shrink_plan's choice (tests force each path)
    x_scale: torch.Tensor | None = None,
    token_order: torch.Tensor | None = None,
) -> torch.Tensor:
    t, h = x.shape
    num_slots, k, h_a = lora_a.shape
    bad_scale = x_scale is not None and x_scale.numel() != (t if x_scale.dim() == 2 else 1)
    if h_a != h or token_slots.shape != (t,) or bad_scale:
        raise ValueError(f"lora_shrink: x {tuple(x.shape)}, lora_a {tuple(lora_a.shape)}, "
                         f"token_slots {tuple(token_slots.shape)}")  # fmt: skip
    y = torch.empty(t, k, dtype=lora_a.dtype, device=x.device)
    if t == 0:
        return y
    plan = plan or shrink_plan(t, h, k, num_slots, x.device)
    order = _order(token_order, t, x.device)
    launch = shrink_launch(x, lora_a, token_slots, y, plan, x_scale, order)
    _lora_shrink_kernel[launch.grid](*launch.args, **launch.constexprs)
    return y


def expand_launch(
    out: torch.Tensor,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_bounds: tuple[int, ...],
    plan: LoraPlan,
    token_order: torch.Tensor,
) -> Launch:
    t, n = out.shape
    rank = lora_b.shape[2]
    inner = [*slice_bounds[1:-1], n, n][:2]  # the boundaries between slices, n where fewer
    return Launch(
        (_cdiv(n, plan.block_n), _cdiv(t, plan.block_m), plan.slot_groups),
        (out, y, lora_b, token_slots, token_order, t, n, rank, inner[0], inner[1],
         plan.slot_groups,
         *out.stride(), *y.stride(), *lora_b.stride()),
        dict(PRECISION=dot_precision(y.dtype), SLICES=len(slice_bounds) - 1,
             BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
             BLOCK_R=_pow2_at_least_16(rank)),
    )  # fmt: skip


def expand_with_plan(
    out: torch.Tensor,
    y: torch.Tensor,
    lora_b: torch.Tensor,
    token_slots: torch.Tensor,
    slice_bounds: tuple[int, ...],
    plan: LoraPlan | None,  # None: expand_plan's choice (tests force each path)
    token_order: torch.Tensor | None = None,
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
    order = _order(token_order, t, out.device)
    launch = expand_launch(out, y, lora_b, token_slots, slice_bounds, plan, order)
    _lora_expand_kernel[launch.grid](*launch.args, **launch.constexprs)
