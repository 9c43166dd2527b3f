"""Paged prefill attention for Hopper (sm_90) in Gluon: FlashAttention-3's structure over kiln's
paged cache (twin: reference.paged_prefill_attention).

One program per (query head, tile of BLOCK_M query tokens, sequence), warp-specialised:
- a load partition (one warp) copies each key tile's K and V into a ring of STAGES shared-memory
  slots with TMA. TMA cannot gather, so a tile of BLOCK_N keys is one copy per page piece
  (block_size rows of one KV head lie together, head-major) and per 128 bytes of columns (one
  swizzle row), all onto the slot's mbarrier, which expects the whole tile's bytes. Pieces past
  the sequence's end are copied from a row past the cache's end, which TMA fills with zeros, so
  the byte count never depends on the sequence;
- two attention partitions (one warpgroup each: the default partition and a worker, 64 of the
  tile's query rows each) run Q @ K^T and P @ V as async warpgroup MMAs, the softmax of tile j
  while the tensor cores run P @ V of tile j - 1, and free each slot's K and V (an mbarrier both
  arrive at) once the MMA reading it is done. Neither waits for the other, so one's softmax
  runs while the other's MMAs do (FA3's two warpgroups, without its explicit ping-pong order).
Only tiles that hold a key past the tile's first query position (the diagonal, the sequence's end)
are masked. Q is loaded once into shared memory (an MMA operand from there, as in FA3).

Over a float8 cache with fp8_qk, each query row goes to e4m3 at its own scale (as the
twin's quantize_fp8), Q @ K^T is a float8 MMA whose row scales join the softmax's, and each
attention warpgroup widens V to bf16 in its own buffer (under the next tile's Q @ K^T) for a
16-bit P @ V: Hopper's float8 MMA reads B K-major only, and V's rows are not. Rows of a page
piece past the sequence's end are read as they lie (masked out of the softmax; the engine's
caches start zeroed, so they hold finite values).

prefill_attention.paged_prefill_attention hands a call here where applies(): supports() (what
this kernel runs) and the cache's dtype in SELECTED: bf16 (622 against the Triton kernel's 437
TFLOP/s at 16k causal on an H100); a float8 cache stays on the Triton kernel (455 against 478).
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from kiln.kernels.kv_layout import check_head_major
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.kernels.triton._device import output_like, unit_stride_rows

_LOG2E = 1.4426950408889634
_FP8_MAX = gl.constexpr(FP8_E4M3_MAX)
_FP8_MIN_SCALE = gl.constexpr(FP8_MIN_SCALE)

# The tiles (FA3's for head_dim 128 under a causal mask): 128 query rows on two consumer
# warpgroups, 128 keys a tile, two K/V slots (Q 32 KB + 2 x (K 32 KB + V 32 KB) of shared memory).
BLOCK_M = 128
BLOCK_N = 128
STAGES = 2
# Attention partitions, BLOCK_M // CONSUMERS query rows each: 2 of one warpgroup each (their
# softmax and MMAs interleave freely), or 1 of two warpgroups in lockstep (launch_config).
CONSUMERS = 2
CONSUMER_REGS = 240  # the attention worker's registers a thread (FA3's)
LOAD_WARPS = 1
LOAD_REGS = 24
# Names that differ between Triton 3.6 (the GPU machines') and later releases.
_UNDERSCORE_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "_reinterpret"))
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


def chunk_layout(element_size: int) -> gl.NVMMASharedLayout:
    """Shared layout of a TMA box of 128-byte rows (64 bf16 or 128 float8): 128-byte swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8 * element_size, rank=2)


def piece_rows(block_size: int) -> int:
    """Rows of one TMA copy: a page piece (a block's rows of one KV head) or a whole tile."""
    return min(block_size, BLOCK_N)


def supports(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    fp8_qk: bool = False,
) -> bool:
    """Whether this kernel can run this call: an sm_90 GPU, head_dim 128, a bf16 query over a
    bf16 cache, or over a float8 cache with float8 Q @ K^T (fp8_qk), a power-of-two block
    size of at least 16, and none of the attention kinds it does not implement (window,
    soft-cap, sinks; a widened float8 cache, float8 P @ V)."""
    block_size = k_cache.shape[1]
    plain = k_cache.dtype == torch.bfloat16  # float8 dots are for float8 caches only
    fp8_qk = k_cache.dtype == torch.float8_e4m3fn and fp8_qk
    return (
        query.is_cuda
        and torch.cuda.get_device_capability(query.device) == (9, 0)
        and query.dtype == torch.bfloat16
        and (plain or fp8_qk)
        and query.shape[2] == 128
        and block_size >= 16
        and block_size & (block_size - 1) == 0
        and window is None
        and softcap is None
        and sinks is None
        and k_cache.numel() // 128 < 2**31 - BLOCK_N  # TMA row coordinates are int32
    )


# The caches whose calls prefill_attention hands to this kernel where supports() holds: those
# where it passed tests/kernels/test_prefill_attention_hopper.py and beat the Triton kernel in
# benchmarks/kernels_gpu.py --long on an H100.
SELECTED: set[torch.dtype] = {torch.bfloat16}


def applies(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    fp8_qk: bool = False,
) -> bool:
    """Whether prefill_attention.paged_prefill_attention hands this call to this kernel."""
    return k_cache.dtype in SELECTED and supports(query, k_cache, window, softcap, sinks, fp8_qk)


@gluon.jit
def _piece_row(
    block_table, n, seq_len, kv_row, oob_row,
    NUM_KV_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr,
):  # fmt: skip
    """The cache row (of the [num_blocks * num_kv_heads * block_size, head_dim] view) where the
    piece holding key n starts: its block's rows of this KV head (kv_row = kv_head *
    BLOCK_SIZE); oob_row (past the view's end: TMA fills zeros) when n is past the sequence."""
    valid = n < seq_len
    block_id = gl.load(block_table + n // BLOCK_SIZE, mask=valid, other=0)
    row = block_id * (NUM_KV_HEADS * BLOCK_SIZE) + kv_row + n % BLOCK_SIZE
    return gl.where(valid, row, oob_row)


@gluon.jit
def _load_tile(
    desc, smem, ready, empty, t, n_start, block_table, seq_len, kv_row, oob_row,
    NUM_KV_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, KV_BYTES: gl.constexpr,
):  # fmt: skip
    """Key tile t's K (or V) into slot t % STAGES, once the consumers freed it; smem is
    [STAGES * CHUNKS * PIECES, ROWS, CHUNK], a slot's (chunk, piece) boxes in that order."""
    CHUNK: gl.constexpr = 128 // KV_BYTES  # elements in a 128-byte swizzle row
    CHUNKS: gl.constexpr = HEAD_DIM // CHUNK
    PIECES: gl.constexpr = BLOCK_N // ROWS
    slot = t % STAGES
    # The slot's previous use was tile t - STAGES; a fresh barrier passes phase 1 at once.
    mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), BLOCK_N * HEAD_DIM * KV_BYTES)
    for p in gl.static_range(PIECES):
        row = _piece_row(block_table, n_start + p * ROWS, seq_len, kv_row, oob_row,
                         NUM_KV_HEADS, BLOCK_SIZE)  # fmt: skip
        for c in gl.static_range(CHUNKS):
            box = smem.index((slot * CHUNKS + c) * PIECES + p)
            _tma_load(desc, [row, c * CHUNK], ready.index(slot), box)


@gluon.jit
def _load_partition(
    k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
    block_table, seq_len, num_tiles, kv_row, oob_row,
    NUM_KV_HEADS: gl.constexpr, BLOCK_SIZE: gl.constexpr, BLOCK_N: gl.constexpr,
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr, KV_BYTES: gl.constexpr,
):  # fmt: skip
    for t in range(num_tiles):
        n_start = t * BLOCK_N
        _load_tile(k_desc, k_smem, k_ready, k_empty, t, n_start, block_table, seq_len, kv_row,
                   oob_row, NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS,
                   KV_BYTES)  # fmt: skip
        _load_tile(v_desc, v_smem, v_ready, v_empty, t, n_start, block_table, seq_len, kv_row,
                   oob_row, NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS,
                   KV_BYTES)  # fmt: skip


@gluon.jit
def _release(empty, slot):
    """This partition's share of freeing a slot (each attention partition arrives once), once
    every warp of the partition is past the MMA that read it (an arrive comes from one thread)."""
    _partition_barrier()
    mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def _widen(v8_smem, v16_smem, layout: gl.constexpr):
    """A float8 V tile to bf16 (exact) in this warpgroup's buffer, for a 16-bit P @ V: Hopper's
    float8 MMA reads its B operand K-major only, which V (dims contiguous) is not."""
    v16_smem.store(v8_smem.load(layout).to(gl.bfloat16))
    fence_async_shared()  # the MMA reads it through the async proxy, after a barrier


@gluon.jit
def _softmax_tile(
    s, m_i, q_pos, n_start, seq_len, first_pos, row_scale,
    BLOCK_N: gl.constexpr, mma_layout: gl.constexpr,
):  # fmt: skip
    """Tile scores s (raw Q @ K^T, each row to be multiplied by its row_scale: softmax scale *
    log2(e), times a float8 query row's scale) to unnormalised weights against the new row
    maxima (log2 domain): (p, m_new, alpha). Only a tile holding a key past the first query
    row's position is masked (the diagonal and the sequence's end lie there)."""
    if n_start + BLOCK_N - 1 > first_pos:
        cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < seq_len)
        s = gl.where(visible, s, float("-inf"))
    # Every row sees key 0 in tile 0, so its maximum is finite from there on.
    m_new = gl.maximum(m_i, gl.max(s, 1) * row_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * row_scale[:, None] - m_new[:, None])
    return p, m_new, alpha


@gluon.jit
def _attend_partition(
    q_ptr, out_ptr, q_all, k_mma, v_mma, v16_all, k_ready, v_ready, k_empty, v_empty,
    q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, WG: gl.constexpr, ROWS_WG: gl.constexpr,
    FP8_QK: gl.constexpr,
):  # fmt: skip
    """Warpgroup WG's ROWS_WG query rows of the program's BLOCK_M (first_pos: the program's
    first query position)."""
    # [ROWS_WG, 128] fp32 accumulators (16 rows a warp): the scores' (K of 32 a float8
    # instruction) and the output's; the same registers either way.
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0],
        warps_per_cta=[NUM_WARPS, 1],
        instr_shape=[16, BLOCK_N, 32 if FP8_QK else 16],
    )
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, HEAD_DIM, 16]
    )
    rows_layout: gl.constexpr = gl.SliceLayout(1, mma_layout)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])
    widen_layout: gl.constexpr = gl.BlockedLayout([1, 16], [4, 8], [NUM_WARPS, 1], [1, 0])

    # This warpgroup's rows of Q into shared memory (rows past the chunk are zeros, unstored).
    q_smem = q_all.index(WG)
    row0 = m_block * BLOCK_M + WG * ROWS_WG
    rows = row0 + gl.arange(0, ROWS_WG, layout=gl.SliceLayout(1, io_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    tokens = (q_start + rows).to(gl.int64)
    io_mask = (rows < q_len)[:, None]
    q = gl.load(q_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=io_mask, other=0.0)  # fmt: skip
    if FP8_QK:
        # Each (token, head) row to e4m3 at its absmax / 448, rounded as the twin's
        # quantize_fp8 (the quotient from the reciprocal and two FMAs: fp8_gemm.scaled_to_e4m3).
        q = q.to(gl.float32)
        q_scale = gl.maximum(gl.div_rn(gl.max(gl.abs(q), 1), _FP8_MAX), _FP8_MIN_SCALE)
        inv_scale = gl.div_rn(gl.full_like(q_scale, 1.0), q_scale)
        quotient = q * inv_scale[:, None]
        remainder = gl.fma(quotient, q_scale[:, None], q * -1.0)
        quotient = gl.fma(remainder, inv_scale[:, None] * -1.0, quotient)
        quotient = gl.minimum(gl.maximum(quotient, -_FP8_MAX), _FP8_MAX)
        q_smem.store(quotient.to(gl.float8e4nv))
        row_scale = gl.convert_layout(q_scale, gl.SliceLayout(1, s_layout)) * qk_scale
    else:
        q_smem.store(q)
        row_scale = gl.full([ROWS_WG], qk_scale, gl.float32, gl.SliceLayout(1, s_layout))
    fence_async_shared()  # the MMAs read it through the async proxy
    _partition_barrier()

    first_pos = first_pos + WG * ROWS_WG  # this warpgroup's first query position
    q_pos = first_pos + gl.arange(0, ROWS_WG, layout=gl.SliceLayout(1, s_layout))
    s_zero = gl.zeros([ROWS_WG, BLOCK_N], gl.float32, s_layout)
    v16_smem = v16_all.index(WG)  # FP8_QK: this warpgroup's V tile widened to bf16

    # Tile 0: its scores, then its weights (the accumulator starts at P0 @ V0 below).
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_mma.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)  # fmt: skip
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    _release(k_empty, 0)
    m_i = gl.full([ROWS_WG], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, alpha = _softmax_tile(s, m_i, q_pos, 0, seq_len, first_pos, row_scale, BLOCK_N,
                                  s_layout)  # fmt: skip
    l_i = gl.convert_layout(gl.sum(p, 1), rows_layout)
    p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)
    acc = gl.zeros([ROWS_WG, HEAD_DIM], gl.float32, mma_layout)

    for t in range(1, num_tiles):
        slot = t % STAGES
        prev = (t - 1) % STAGES
        # S_t = Q @ K_t^T, then P_{t-1} @ V_{t-1}, both in flight.
        mbarrier.wait(k_ready.index(slot), (t // STAGES) & 1)
        s_tok = warpgroup_mma(q_smem, k_mma.index(slot).permute((1, 0)), s_zero, use_acc=False,
                              is_async=True)  # fmt: skip
        mbarrier.wait(v_ready.index(prev), ((t - 1) // STAGES) & 1)
        if FP8_QK:  # V_{t-1} widened under Q @ K_t^T; its float8 slot freed at once
            _widen(v_mma.index(prev), v16_smem, widen_layout)
            _release(v_empty, prev)
            acc_tok = warpgroup_mma(p_op, v16_smem, acc, is_async=True)
        else:
            acc_tok = warpgroup_mma(p_op, v_mma.index(prev), acc, is_async=True)
        # S_t done (the older group); its softmax runs under P_{t-1} @ V_{t-1}.
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        _release(k_empty, slot)
        p, m_i, alpha = _softmax_tile(s, m_i, q_pos, t * BLOCK_N, seq_len, first_pos, row_scale,
                                      BLOCK_N, s_layout)  # fmt: skip
        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        if FP8_QK:
            _partition_barrier()  # every warpgroup of the partition is done reading v16_smem
        else:
            _release(v_empty, prev)
        rescale = gl.convert_layout(alpha, rows_layout)
        acc = acc * rescale[:, None]
        l_i = l_i * rescale + gl.convert_layout(gl.sum(p, 1), rows_layout)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    last = num_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
    if FP8_QK:
        _widen(v_mma.index(last % STAGES), v16_smem, widen_layout)
        _partition_barrier()  # every warp's part of the tile stored before the MMA reads it
        acc_tok = warpgroup_mma(p_op, v16_smem, acc, is_async=True)
    else:
        acc_tok = warpgroup_mma(p_op, v_mma.index(last % STAGES), acc, is_async=True)
    acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))

    out = acc / l_i[:, None]
    out = gl.convert_layout(out.to(out_ptr.dtype.element_ty), io_layout)
    gl.store(out_ptr + tokens[:, None] * stride_o_token + head * stride_o_head + dims[None, :],
             out, mask=io_mask)  # fmt: skip


@gluon.jit
def _prefill_kernel(
    q_ptr, k_desc, v_desc, block_tables_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    qk_scale, oob_row,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head, stride_bt_seq,
    NUM_KV_HEADS: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_SIZE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    STAGES: gl.constexpr, ROWS: gl.constexpr, NUM_WARPS: gl.constexpr, CONSUMERS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, LOAD_WARPS: gl.constexpr, LOAD_REGS: gl.constexpr,
    FP8_QK: gl.constexpr, KV_BYTES: gl.constexpr,
):  # fmt: skip
    # Heads fastest: the GROUP heads reading one KV head's tiles run side by side (L2 reuse);
    # query tiles reversed so the longest (most keys under the causal mask) start first.
    head = gl.program_id(0)
    m_block = gl.num_programs(1) - 1 - gl.program_id(1)
    seq = gl.program_id(2)
    q_start = gl.load(query_start_loc_ptr + seq)
    q_len = gl.load(query_start_loc_ptr + seq + 1) - q_start
    if m_block * BLOCK_M < q_len:  # the grid covers the longest chunk
        seq_len = gl.load(seq_lens_ptr + seq)
        first_pos = seq_len - q_len + m_block * BLOCK_M  # the tile's first query position
        # Keys from the diagonal's end on are past every row of the tile; >= 1 tile.
        num_tiles = gl.cdiv(gl.minimum(seq_len, first_pos + BLOCK_M), BLOCK_N)
        block_table = block_tables_ptr + seq.to(gl.int64) * stride_bt_seq
        kv_row = (head // GROUP) * BLOCK_SIZE

        CHUNK: gl.constexpr = 128 // KV_BYTES  # elements in a 128-byte swizzle row
        CHUNKS: gl.constexpr = HEAD_DIM // CHUNK
        PIECES: gl.constexpr = BLOCK_N // ROWS
        kv_dtype: gl.constexpr = k_desc.dtype
        # One layout a dtype (a leading dimension indexes slots or boxes): 128-byte swizzle.
        layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        kv_layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=8 * KV_BYTES, rank=2
        )
        ROWS_WG: gl.constexpr = BLOCK_M // CONSUMERS
        # Q as the Q @ K^T MMA reads it: bf16, or float8 beside a float8 K.
        q_all = gl.allocate_shared_memory(kv_dtype, [CONSUMERS, ROWS_WG, HEAD_DIM], kv_layout)
        # TMA writes [ROWS, CHUNK] boxes; the MMAs read [BLOCK_N, HEAD_DIM] tiles of the same
        # bytes (a 128-byte-swizzled tile lies as its 128-byte column chunks one after another).
        k_smem = gl.allocate_shared_memory(kv_dtype, [STAGES * CHUNKS * PIECES, ROWS, CHUNK],
                                           kv_layout)  # fmt: skip
        v_smem = gl.allocate_shared_memory(kv_dtype, [STAGES * CHUNKS * PIECES, ROWS, CHUNK],
                                           kv_layout)  # fmt: skip
        if _UNDERSCORE_REINTERPRET:
            k_mma = k_smem._reinterpret(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
            v_mma = v_smem._reinterpret(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        else:
            k_mma = k_smem.reinterpret(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
            v_mma = v_smem.reinterpret(kv_dtype, [STAGES, BLOCK_N, HEAD_DIM], kv_layout)
        if FP8_QK:  # each attention partition's V tile widened to bf16
            v16_all = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, BLOCK_N, HEAD_DIM],
                                                layout)  # fmt: skip
        else:
            v16_all = q_all  # unused
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=CONSUMERS)
            mbarrier.init(v_empty.index(i), count=CONSUMERS)
        fence_async_shared()

        if CONSUMERS == 2:
            gl.warp_specialize(
                [
                    (_attend_partition,
                     (q_ptr, out_ptr, q_all, k_mma, v_mma, v16_all, k_ready, v_ready, k_empty,
                      v_empty,
                      q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS, 0, ROWS_WG, FP8_QK)),
                    (_attend_partition,
                     (q_ptr, out_ptr, q_all, k_mma, v_mma, v16_all, k_ready, v_ready, k_empty,
                      v_empty,
                      q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS, 1, ROWS_WG, FP8_QK)),
                    (_load_partition,
                     (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                      block_table, seq_len, num_tiles, kv_row, oob_row,
                      NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS, KV_BYTES)),
                ],
                [NUM_WARPS, LOAD_WARPS],
                [CONSUMER_REGS, LOAD_REGS],
            )  # fmt: skip
        else:  # one attention partition of two warpgroups (their 64-row halves in lockstep)
            gl.warp_specialize(
                [
                    (_attend_partition,
                     (q_ptr, out_ptr, q_all, k_mma, v_mma, v16_all, k_ready, v_ready, k_empty,
                      v_empty,
                      q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS, 0, ROWS_WG, FP8_QK)),
                    (_load_partition,
                     (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                      block_table, seq_len, num_tiles, kv_row, oob_row,
                      NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS, KV_BYTES)),
                ],
                [LOAD_WARPS],
                [LOAD_REGS],
            )  # fmt: skip


def cache_descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over a head-major cache as [num_blocks * num_kv_heads * block_size,
    head_dim] rows, boxes of one page piece by 128 bytes of columns."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.transpose(1, 2).reshape(num_blocks * num_kv_heads * block_size, head_dim)
    size = cache.element_size()
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()),
                            [piece_rows(block_size), 128 // size], chunk_layout(size))  # fmt: skip


def launch_config(
    query: torch.Tensor, k_cache: torch.Tensor, max_query_len: int, num_seqs: int
) -> tuple[tuple[int, int, int], dict]:
    """(grid, the kernel's constexprs and launch options) for one call."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    grid = (num_heads, triton.cdiv(max_query_len, BLOCK_M), num_seqs)
    num_warps = 4 * (BLOCK_M // 64) // CONSUMERS  # an attention partition's: 64 rows a warpgroup
    meta = {
        "NUM_KV_HEADS": num_kv_heads,
        "GROUP": num_heads // num_kv_heads,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": block_size,
        "BLOCK_M": BLOCK_M,
        "BLOCK_N": BLOCK_N,
        "STAGES": STAGES,
        "ROWS": piece_rows(block_size),
        "NUM_WARPS": num_warps,
        "CONSUMERS": CONSUMERS,
        "CONSUMER_REGS": CONSUMER_REGS,
        "LOAD_WARPS": LOAD_WARPS,
        "LOAD_REGS": LOAD_REGS,
        "FP8_QK": k_cache.element_size() == 1,
        "KV_BYTES": k_cache.element_size(),
        "num_warps": num_warps,
    }
    return grid, meta


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, 128] bf16, packed sequences
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, 128] bf16, head-major
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    fp8_qk: bool = False,  # a float8 cache: float8 Q @ K^T (its only float8 mode)
) -> torch.Tensor:  # [num_tokens, num_heads, 128]
    """Causal attention for chunks whose earlier context is in the cache, where supports()."""
    num_tokens, num_heads, head_dim = query.shape
    assert num_heads % k_cache.shape[2] == 0 and k_cache.shape[3] == head_dim
    assert k_cache.element_size() == 2 or fp8_qk, "a float8 cache needs fp8_qk"
    check_head_major(k_cache, v_cache)
    out = output_like(query, out)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    query, block_tables = unit_stride_rows(query, block_tables)
    k_desc, v_desc = cache_descriptor(k_cache), cache_descriptor(v_cache)
    grid, meta = launch_config(query, k_cache, max_query_len, num_seqs)
    _prefill_kernel[grid](
        query, k_desc, v_desc, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E, k_desc.shape[0],
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        **meta,
    )  # fmt: skip
    return out
