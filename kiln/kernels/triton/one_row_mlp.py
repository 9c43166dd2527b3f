"""The FP8 MLP block of one row (batch-1 decode) in one launch: residual add + RMSNorm, gate_up,
SiLU-mul, then the down projection (twin: reference.add_rms_norm_mlp_fp8).

Why: at batch 1 each kernel costs ~4-5 us beyond its bytes on the H200: the launch itself (~1.2
us in a graph), the first loads' wait and the drain of its last programs
(docs/performance.md, "The H200 on 2026-12-05, third session"). The MLP block was two launches,
small_batch_linear's gate_up kernel, then its down kernel. Down cannot start before the whole
activation exists (it reads whole weight rows, so each of its programs needs every column of the
activation: the chunked one-kernel block that avoided this read down 64 bytes at a time and ran
1.7x slower, docs/performance.md, "The FP8 MLP block of one row in one kernel").

How: one grid holds gate_up's programs and down's. Each program takes a ticket (an atomic add)
when it starts: the first tickets run gate_up's tiles, the rest down's (tile and split). A gate_up
program, once its part of the activation is stored, adds one to a done-counter; a down program
waits for that counter to reach gate_up's program count before its loop. Down's programs start
while gate_up's last ones drain (in the slots they leave), and no launch separates the two.
Tickets, not program ids, give the roles: a down program waits only for work that running
programs have already taken, so the wait cannot deadlock whatever order the GPU starts programs
in. The programs are small_batch_linear's own (_linear_program), with the tiles
small_batch_tiles chooses for each projection, so the results equal the two launches' bit for
bit. The launch's last program puts the counters back to zero: a CUDA graph replays the launch
with no memset node.

Under the Triton interpreter programs run one after another in order: every down program finds
the counter complete, and the CPU tests check the arithmetic and the bookkeeping, not the wait.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.envs import envs
from kiln.kernels.triton import small_batch_tiles, split_k
from kiln.kernels.triton._device import dot_precision, num_sms
from kiln.kernels.triton.small_batch_linear import (
    _ADD_NORM,
    _NORM,
    _fits,
    _fp8_dot,
    _linear_program,
    _quant_mode,
    _rows_2d,
    add_rms_norm_linear_silu_mul_fp8,
    fp8_linear,
    fp8_matmul,
    swap_ab,
)

# Whether the engine's FP8 MLP at one row runs one launch: 0 its two kernels, 1 the ticket
# schedule, 2 the cooperative one (GPU only; see _persistent_programs). KILN_ONE_ROW_MLP, read at
# import; module-level so a benchmark can time each in one process.
ENABLED = envs().one_row_mlp

# The ticket, gate_up's done-counter, down's finished-counter: one buffer per device, zeroed once.
_SYNC_WORDS = 3
# K-steps of its weight tile a down program asks L2 for before it waits (0: none): the loads
# after the wait then start from L2. Module-level so the benchmark times both.
DOWN_PREFETCH_STEPS = 0


@triton.jit
def _prefetch_to_l2(w_ptr, row0, k0, stride, ROWS: tl.constexpr, BYTES: tl.constexpr):
    """Asks L2 for rows [row0, row0 + ROWS) x bytes [k0, k0 + BYTES) of a float8 weight, one
    128-byte line at a time (PTX prefetch: nothing comes back, nothing waits)."""
    rows = row0 + tl.arange(0, ROWS)
    lines = k0 + 128 * tl.arange(0, BYTES // 128)
    ptrs = w_ptr + rows[:, None].to(tl.int64) * stride + lines[None, :]
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _one_row_mlp_kernel(
    x_ptr,  # [1, K]
    residual_ptr,  # [1, K], read when PROLOGUE is ADD_NORM
    norm_weight_ptr,  # [K]
    sum_ptr,  # [1, K]: x + residual, written when ADD_NORM
    gate_up_ptr,  # [2N, K] float8: the gate rows, then the up rows
    gate_up_scale_ptr,  # [2N] fp32
    gate_up_in_scale_ptr,  # [] fp32, read when GATE_UP_QUANT is static
    act_ptr,  # [1, N]: silu(gate) * up, in the model dtype
    down_ptr,  # [K, N] float8
    down_scale_ptr,  # [K] fp32
    down_in_scale_ptr,  # [] fp32, read when DOWN_QUANT is static
    out_ptr,  # [1, K]
    part_ptr,  # [DOWN_SPLIT_K, 1, 1, K] fp32: down's partial sums (split_k.py)
    counter_ptr,  # split_k.counters: down's tile tickets
    sync_ptr,  # [_SYNC_WORDS] int32 zeros (see the module's docstring)
    N,
    K,
    down_k_per_split,
    stride_gate_up,
    stride_down,
    eps,
    PROLOGUE: tl.constexpr,  # small_batch_linear's _NORM or _ADD_NORM
    GATE_UP_QUANT: tl.constexpr,  # small_batch_linear._project's QUANT: 1 dynamic, 2 static
    DOWN_QUANT: tl.constexpr,
    GATE_UP_BLOCK_N: tl.constexpr,  # rows of each half a gate_up program streams
    GATE_UP_BLOCK_K: tl.constexpr,
    GATE_UP_STATS_BLOCK: tl.constexpr,
    GATE_UP_SWAP: tl.constexpr,
    DOWN_BLOCK_N: tl.constexpr,
    DOWN_BLOCK_K: tl.constexpr,
    DOWN_STATS_BLOCK: tl.constexpr,
    DOWN_SPLIT_K: tl.constexpr,
    DOWN_SWAP: tl.constexpr,
    DOWN_PREFETCH_STEPS: tl.constexpr,  # see DOWN_PREFETCH_STEPS (the GPU only)
    DOT_PRECISION: tl.constexpr,
    FP8_DOT: tl.constexpr,
    INTERPRETED: tl.constexpr,
    PERSISTENT: tl.constexpr = False,  # the cooperative schedule (see _persistent_programs)
):
    gate_up_programs = tl.cdiv(N, GATE_UP_BLOCK_N)
    down_programs = tl.cdiv(K, DOWN_BLOCK_N) * DOWN_SPLIT_K
    if PERSISTENT:
        # As many programs as fit on the GPU at once (a cooperative launch: it fails rather than
        # start fewer), each taking every num_programs-th tile of gate_up, then of down; no
        # ticket, and every program counts itself done with gate_up once.
        me = tl.program_id(0)
        programs = tl.num_programs(0)
        for item in range(me, gate_up_programs, programs):
            _linear_program(
                item, 0, item, gate_up_programs, x_ptr, residual_ptr, norm_weight_ptr,
                gate_up_ptr, gate_up_ptr, act_ptr, sum_ptr, gate_up_scale_ptr,
                gate_up_in_scale_ptr, part_ptr, counter_ptr, 1, N, K, K, K, N, stride_gate_up,
                eps, PROLOGUE, False, True, 16, GATE_UP_BLOCK_N, GATE_UP_BLOCK_K,
                GATE_UP_STATS_BLOCK, 1, DOT_PRECISION, GATE_UP_QUANT, FP8_DOT, INTERPRETED,
                GATE_UP_SWAP,
            )  # fmt: skip
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
        if DOWN_PREFETCH_STEPS > 0 and me < down_programs:
            _prefetch_to_l2(
                down_ptr, (me // DOWN_SPLIT_K) * DOWN_BLOCK_N,
                (me % DOWN_SPLIT_K) * down_k_per_split, stride_down, DOWN_BLOCK_N,
                DOWN_PREFETCH_STEPS * DOWN_BLOCK_K,
            )  # fmt: skip
        ready = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        while ready < programs:
            ready = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        for item in range(me, down_programs, programs):
            _linear_program(
                item // DOWN_SPLIT_K, item % DOWN_SPLIT_K, 0, 1, act_ptr, act_ptr, act_ptr,
                down_ptr, down_ptr, out_ptr, out_ptr, down_scale_ptr, down_in_scale_ptr,
                part_ptr, counter_ptr, 1, K, N, down_k_per_split, N, K, stride_down, eps, 0,
                False, False, 16, DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_STATS_BLOCK, DOWN_SPLIT_K,
                DOT_PRECISION, DOWN_QUANT, FP8_DOT, INTERPRETED, DOWN_SWAP,
            )  # fmt: skip
        tl.debug_barrier()
        finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if finished == programs - 1:
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")
        return
    work = tl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
    if work < gate_up_programs:
        _linear_program(
            work, 0, work, gate_up_programs, x_ptr, residual_ptr, norm_weight_ptr, gate_up_ptr,
            gate_up_ptr, act_ptr, sum_ptr, gate_up_scale_ptr, gate_up_in_scale_ptr, part_ptr,
            counter_ptr, 1, N, K, K, K, N, stride_gate_up, eps, PROLOGUE, False, True, 16,
            GATE_UP_BLOCK_N, GATE_UP_BLOCK_K, GATE_UP_STATS_BLOCK, 1, DOT_PRECISION,
            GATE_UP_QUANT, FP8_DOT, INTERPRETED, GATE_UP_SWAP,
        )  # fmt: skip
        # Every thread's activation stores before the count (release: down's acquire sees them).
        tl.debug_barrier()
        tl.atomic_add(sync_ptr + 1, 1, sem="release", scope="gpu")
    else:
        down_work = work - gate_up_programs
        if DOWN_PREFETCH_STEPS > 0 and not INTERPRETED:
            _prefetch_to_l2(
                down_ptr, (down_work // DOWN_SPLIT_K) * DOWN_BLOCK_N,
                (down_work % DOWN_SPLIT_K) * down_k_per_split, stride_down, DOWN_BLOCK_N,
                DOWN_PREFETCH_STEPS * DOWN_BLOCK_K,
            )  # fmt: skip
        ready = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        while ready < gate_up_programs:
            ready = tl.atomic_add(sync_ptr + 1, 0, sem="acquire", scope="gpu")
        _linear_program(
            down_work // DOWN_SPLIT_K, down_work % DOWN_SPLIT_K, 0, 1, act_ptr, act_ptr, act_ptr,
            down_ptr, down_ptr, out_ptr, out_ptr, down_scale_ptr, down_in_scale_ptr, part_ptr,
            counter_ptr, 1, K, N, down_k_per_split, N, K, stride_down, eps, 0, False, False, 16,
            DOWN_BLOCK_N, DOWN_BLOCK_K, DOWN_STATS_BLOCK, DOWN_SPLIT_K, DOT_PRECISION,
            DOWN_QUANT, FP8_DOT, INTERPRETED, DOWN_SWAP,
        )  # fmt: skip
        tl.debug_barrier()
        finished = tl.atomic_add(sync_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if finished == down_programs - 1:
            # The launch's last program: every ticket is taken and every wait is over.
            tl.atomic_xchg(sync_ptr, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 1, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(sync_ptr + 2, 0, sem="relaxed", scope="gpu")


def _one_launch_fits(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    gate_up_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_scale: torch.Tensor,
    down_input_scale: torch.Tensor | None,
) -> bool:
    n = gate_up_weight.shape[0] // 2
    return (
        ENABLED > 0
        and _fits(x, gate_up_weight, x.shape[-1], True, gate_up_scale, gate_up_input_scale)
        and norm_weight.dtype == x.dtype
        and (residual is None or (residual.dtype == x.dtype and residual.shape == x.shape))
        and down_weight.shape == (x.shape[-1], n)
        and _fits(x.new_empty(1, n), down_weight, n, False, down_scale, down_input_scale)
        and _same_launch_options(n, x.shape[-1], x.device)
    )


def _same_launch_options(n: int, k: int, device: torch.device) -> bool:
    """Whether gate_up's and down's tiles share warps and stages (one launch has one of each):
    the measured tiles of Llama-3.1-8B's do; other shapes' rule tiles may not."""
    gate_up = small_batch_tiles.tile_config("norm_linear_silu_mul", 2 * n, k, device, 1)
    down = small_batch_tiles.tile_config("linear", k, n, device, 1)
    return (gate_up.num_warps, gate_up.num_stages) == (down.num_warps, down.num_stages)


def add_rms_norm_mlp_fp8(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    gate_up_weight: torch.Tensor,  # [2N, K] float8 e4m3: the gate rows, then the up rows
    gate_up_scale: torch.Tensor,  # [2N] fp32
    gate_up_input_scale: torch.Tensor | None,  # [] fp32 static; None: per token
    down_weight: torch.Tensor,  # [K, N] float8 e4m3
    down_scale: torch.Tensor,  # [K] fp32
    down_input_scale: torch.Tensor | None,  # [] fp32 static; None: per token
) -> tuple[torch.Tensor, torch.Tensor]:  # (down(silu(gate) * up), x + residual)
    """The FP8 MLP block with no bias: one launch for one row (see the module's docstring),
    otherwise add_rms_norm_linear_silu_mul_fp8 and the down projection as two."""
    if not _one_launch_fits(
        x, residual, norm_weight, gate_up_weight, gate_up_scale, gate_up_input_scale,
        down_weight, down_scale, down_input_scale,
    ):  # fmt: skip
        act, act_scale, summed = add_rms_norm_linear_silu_mul_fp8(
            x, residual, norm_weight, eps, gate_up_weight, gate_up_scale, gate_up_input_scale,
            down_input_scale,
        )  # fmt: skip
        if act_scale is None:
            return fp8_linear(act, down_weight, down_scale, down_input_scale), summed
        return fp8_matmul(act, act_scale, down_weight, down_scale, None, x.dtype), summed
    out, summed = _launch(
        _rows_2d(x), residual, norm_weight, eps, gate_up_weight, gate_up_scale,
        gate_up_input_scale, down_weight, down_scale, down_input_scale,
    )  # fmt: skip
    return out.view(x.shape), summed.view(x.shape)


def _launch(
    x2: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_scale: torch.Tensor,
    gate_up_input_scale: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_scale: torch.Tensor,
    down_input_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    device = x2.device
    k = x2.shape[1]
    n = gate_up_weight.shape[0] // 2
    gate_up_tiles = small_batch_tiles.tile_config("norm_linear_silu_mul", 2 * n, k, device, 1)
    down_tiles = small_batch_tiles.tile_config("linear", k, n, device, 1)
    gate_up_block_n = gate_up_tiles.block_n // 2 if device.type == "cuda" else gate_up_tiles.block_n
    per_split, num_splits = split_k.k_per_split(n, down_tiles.split_k, down_tiles.block_k)
    gate_up_quant = _quant_mode(gate_up_scale, gate_up_input_scale, x2)
    down_quant = _quant_mode(down_scale, down_input_scale, x2)
    act = torch.empty((1, n), dtype=x2.dtype, device=device)
    out = torch.empty((1, k), dtype=x2.dtype, device=device)
    summed = torch.empty_like(x2) if residual is not None else x2
    part = split_k.partials(num_splits, 1, 1, k, device=device) if num_splits > 1 else out
    programs = triton.cdiv(n, gate_up_block_n) + triton.cdiv(k, down_tiles.block_n) * num_splits
    persistent = ENABLED == 2 and device.type == "cuda"
    options = {}
    if persistent:
        programs = _persistent_programs(device)
        options = {"launch_cooperative_grid": True, "PERSISTENT": True}
    sync = split_k.counters(device, _SYNC_WORDS, "one_row_mlp")
    _one_row_mlp_kernel[(programs,)](
        x2, _rows_2d(residual) if residual is not None else x2, norm_weight, summed,
        gate_up_weight, gate_up_scale,
        gate_up_input_scale if gate_up_input_scale is not None else gate_up_scale, act,
        down_weight, down_scale,
        down_input_scale if down_input_scale is not None else down_scale, out, part,
        split_k.counters(device), sync, n, k, per_split, gate_up_weight.stride(0),
        down_weight.stride(0), eps,
        PROLOGUE=_ADD_NORM if residual is not None else _NORM,
        GATE_UP_QUANT=gate_up_quant,
        DOWN_QUANT=down_quant,
        GATE_UP_BLOCK_N=gate_up_block_n,
        GATE_UP_BLOCK_K=gate_up_tiles.block_k,
        GATE_UP_STATS_BLOCK=gate_up_tiles.stats_block or gate_up_tiles.block_k,
        GATE_UP_SWAP=swap_ab(gate_up_quant, gate_up_block_n, device),
        DOWN_BLOCK_N=down_tiles.block_n,
        DOWN_BLOCK_K=down_tiles.block_k,
        DOWN_STATS_BLOCK=down_tiles.stats_block or down_tiles.block_k,
        DOWN_SPLIT_K=num_splits,
        DOWN_SWAP=swap_ab(down_quant, down_tiles.block_n, device),
        DOWN_PREFETCH_STEPS=DOWN_PREFETCH_STEPS,
        DOT_PRECISION=dot_precision(x2.dtype),
        FP8_DOT=_fp8_dot(device),
        INTERPRETED=device.type != "cuda",
        num_warps=gate_up_tiles.num_warps,
        num_stages=gate_up_tiles.num_stages,
        **options,
    )  # fmt: skip
    return out, summed


# Programs an SM keeps of the cooperative schedule: the engine's tiles take 103 KiB of shared
# memory and 104 registers a thread (sm_90, Triton 3.6), so two fit in an SM's 228 KiB; a launch
# of more than fit fails (cooperative), it never waits for programs that cannot start.
PERSISTENT_PROGRAMS_PER_SM = 2


def _persistent_programs(device: torch.device) -> int:
    return PERSISTENT_PROGRAMS_PER_SM * num_sms(device)
