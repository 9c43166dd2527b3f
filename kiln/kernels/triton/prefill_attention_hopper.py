"""Paged prefill attention for Hopper (sm_90) in Gluon: FlashAttention-3's structure over kiln's
paged cache (twin: reference.paged_prefill_attention).

One program per (query head, tile of BLOCK_M query tokens, sequence), warp-specialised:
- a load partition (one warp) copies each key tile's K and V into a ring of STAGES shared-memory
  slots with TMA. TMA cannot gather, so a tile of BLOCK_N keys is one copy per page piece
  (block_size rows of one KV head lie together, head-major) and per 64 columns (one 128-byte
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
from kiln.kernels.triton._device import output_like, unit_stride_rows

_LOG2E = 1.4426950408889634

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
_CHUNK = 64  # bf16 columns in one 128-byte swizzle row: a TMA box's widest
# Names that differ between Triton 3.6 (the GPU machines') and later releases.
_UNDERSCORE_REINTERPRET = gl.constexpr(hasattr(gl.shared_memory_descriptor, "_reinterpret"))
_partition_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_tma_load = tma.async_load if hasattr(tma, "async_load") else tma.async_copy_global_to_shared


def _chunk_layout() -> gl.NVMMASharedLayout:
    """Shared layout of a TMA box [rows, 64] of bf16: 128-byte rows, 128-byte swizzle."""
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)


def piece_rows(block_size: int) -> int:
    """Rows of one TMA copy: a page piece (a block's rows of one KV head) or a whole tile."""
    return min(block_size, BLOCK_N)


def applies(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    fp8_dots: str = "none",
) -> bool:
    """Whether this kernel replaces prefill_attention's on this call: an sm_90 GPU, head_dim
    128, bf16 query and cache, a power-of-two block size of at least 16, and none of the
    attention kinds it does not implement (window, soft-cap, sinks, float8 dots)."""
    block_size = k_cache.shape[1]
    return (
        query.is_cuda
        and torch.cuda.get_device_capability(query.device) == (9, 0)
        and query.dtype == torch.bfloat16
        and k_cache.dtype == torch.bfloat16
        and query.shape[2] == 128
        and block_size >= 16
        and block_size & (block_size - 1) == 0
        and window is None
        and softcap is None
        and sinks is None
        and fp8_dots == "none"
        and k_cache.numel() // 128 < 2**31 - BLOCK_N  # TMA row coordinates are int32
    )


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
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr,
):  # fmt: skip
    """Key tile t's K (or V) into slot t % STAGES, once the consumer freed it; smem is
    [STAGES * CHUNKS * PIECES, ROWS, 64], a slot's (chunk, piece) boxes in that order."""
    CHUNK: gl.constexpr = 64
    CHUNKS: gl.constexpr = HEAD_DIM // CHUNK
    PIECES: gl.constexpr = BLOCK_N // ROWS
    slot = t % STAGES
    # The slot's previous use was tile t - STAGES; a fresh barrier passes phase 1 at once.
    mbarrier.wait(empty.index(slot), ((t // STAGES) & 1) ^ 1)
    mbarrier.expect(ready.index(slot), BLOCK_N * HEAD_DIM * 2)
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
    HEAD_DIM: gl.constexpr, STAGES: gl.constexpr, ROWS: gl.constexpr,
):  # fmt: skip
    for t in range(num_tiles):
        n_start = t * BLOCK_N
        _load_tile(k_desc, k_smem, k_ready, k_empty, t, n_start, block_table, seq_len, kv_row,
                   oob_row, NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS)  # fmt: skip
        _load_tile(v_desc, v_smem, v_ready, v_empty, t, n_start, block_table, seq_len, kv_row,
                   oob_row, NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS)  # fmt: skip


@gluon.jit
def _release(empty, slot):
    """This partition's share of freeing a slot (each attention partition arrives once), once
    every warp of the partition is past the MMA that read it (an arrive comes from one thread)."""
    _partition_barrier()
    mbarrier.arrive(empty.index(slot), count=1)


@gluon.jit
def _softmax_tile(
    s, m_i, q_pos, n_start, seq_len, first_pos, qk_scale,
    BLOCK_N: gl.constexpr, mma_layout: gl.constexpr,
):  # fmt: skip
    """Tile scores s (raw Q @ K^T) to unnormalised weights against the new row maxima (log2
    domain): (p, m_new, alpha). Only a tile holding a key past the first query row's position
    is masked (the diagonal and the sequence's end lie there)."""
    if n_start + BLOCK_N - 1 > first_pos:
        cols = n_start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, mma_layout))
        visible = (cols[None, :] <= q_pos[:, None]) & (cols[None, :] < seq_len)
        s = gl.where(visible, s, float("-inf"))
    # Every row sees key 0 in tile 0, so its maximum is finite from there on.
    m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s * qk_scale - m_new[:, None])
    return p, m_new, alpha


@gluon.jit
def _attend_partition(
    q_ptr, out_ptr, q_all, k_mma, v_mma, k_ready, v_ready, k_empty, v_empty,
    q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
    STAGES: gl.constexpr, NUM_WARPS: gl.constexpr, WG: gl.constexpr, ROWS_WG: gl.constexpr,
):  # fmt: skip
    """Warpgroup WG's ROWS_WG query rows of the program's BLOCK_M (first_pos: the program's
    first query position)."""
    # Both MMAs on one layout: [ROWS_WG, 128] fp32 on one warpgroup (16 rows a warp).
    mma_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[NUM_WARPS, 1], instr_shape=[16, BLOCK_N, 16]
    )
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    io_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [NUM_WARPS, 1], [1, 0])

    # This warpgroup's rows of Q into shared memory (rows past the chunk are zeros, unstored).
    q_smem = q_all.index(WG)
    row0 = m_block * BLOCK_M + WG * ROWS_WG
    rows = row0 + gl.arange(0, ROWS_WG, layout=gl.SliceLayout(1, io_layout))
    dims = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, io_layout))
    tokens = (q_start + rows).to(gl.int64)
    io_mask = (rows < q_len)[:, None]
    q = gl.load(q_ptr + tokens[:, None] * stride_q_token + head * stride_q_head + dims[None, :],
                mask=io_mask, other=0.0)  # fmt: skip
    q_smem.store(q)
    fence_async_shared()  # the MMAs read it through the async proxy
    _partition_barrier()

    first_pos = first_pos + WG * ROWS_WG  # this warpgroup's first query position
    q_pos = first_pos + gl.arange(0, ROWS_WG, layout=gl.SliceLayout(1, mma_layout))
    s_zero = gl.zeros([ROWS_WG, BLOCK_N], gl.float32, mma_layout)

    # Tile 0: its scores, then its weights (the accumulator starts at P0 @ V0 below).
    mbarrier.wait(k_ready.index(0), 0)
    s_tok = warpgroup_mma(q_smem, k_mma.index(0).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)  # fmt: skip
    s = warpgroup_mma_wait(0, deps=(s_tok,))
    _release(k_empty, 0)
    m_i = gl.full([ROWS_WG], float("-inf"), gl.float32, gl.SliceLayout(1, mma_layout))
    p, m_i, alpha = _softmax_tile(s, m_i, q_pos, 0, seq_len, first_pos, qk_scale, BLOCK_N,
                                  mma_layout)  # fmt: skip
    l_i = gl.sum(p, 1)
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
        acc_tok = warpgroup_mma(p_op, v_mma.index(prev), acc, is_async=True)
        # S_t done (the older group); its softmax runs under P_{t-1} @ V_{t-1}.
        s = warpgroup_mma_wait(1, deps=(s_tok,))
        _release(k_empty, slot)
        p, m_i, alpha = _softmax_tile(s, m_i, q_pos, t * BLOCK_N, seq_len, first_pos, qk_scale,
                                      BLOCK_N, mma_layout)  # fmt: skip
        acc, _ = warpgroup_mma_wait(0, deps=(acc_tok, p_op))
        _release(v_empty, prev)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha + gl.sum(p, 1)
        p_op = gl.convert_layout(p.to(gl.bfloat16), p_layout)

    last = num_tiles - 1
    mbarrier.wait(v_ready.index(last % STAGES), (last // STAGES) & 1)
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

        CHUNKS: gl.constexpr = HEAD_DIM // 64
        PIECES: gl.constexpr = BLOCK_N // ROWS
        # One layout for all (a leading dimension indexes slots or boxes): 128-byte swizzle.
        layout: gl.constexpr = gl.NVMMASharedLayout(
            swizzle_byte_width=128, element_bitwidth=16, rank=2
        )
        ROWS_WG: gl.constexpr = BLOCK_M // CONSUMERS
        q_all = gl.allocate_shared_memory(gl.bfloat16, [CONSUMERS, ROWS_WG, HEAD_DIM], layout)
        # TMA writes [ROWS, 64] boxes; the MMAs read [BLOCK_N, HEAD_DIM] tiles of the same bytes
        # (a 128-byte-swizzled tile lies as its 64-column chunks one after the other).
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS * PIECES, ROWS, 64],
                                           layout)  # fmt: skip
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * CHUNKS * PIECES, ROWS, 64],
                                           layout)  # fmt: skip
        if _UNDERSCORE_REINTERPRET:
            k_mma = k_smem._reinterpret(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
            v_mma = v_smem._reinterpret(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
        else:
            k_mma = k_smem.reinterpret(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
            v_mma = v_smem.reinterpret(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], layout)
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
                     (q_ptr, out_ptr, q_all, k_mma, v_mma, k_ready, v_ready, k_empty, v_empty,
                      q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS, 0, ROWS_WG)),
                    (_attend_partition,
                     (q_ptr, out_ptr, q_all, k_mma, v_mma, k_ready, v_ready, k_empty, v_empty,
                      q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS, 1, ROWS_WG)),
                    (_load_partition,
                     (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                      block_table, seq_len, num_tiles, kv_row, oob_row,
                      NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS)),
                ],
                [NUM_WARPS, LOAD_WARPS],
                [CONSUMER_REGS, LOAD_REGS],
            )  # fmt: skip
        else:  # one attention partition of two warpgroups (their 64-row halves in lockstep)
            gl.warp_specialize(
                [
                    (_attend_partition,
                     (q_ptr, out_ptr, q_all, k_mma, v_mma, k_ready, v_ready, k_empty, v_empty,
                      q_start, q_len, m_block, head, seq_len, first_pos, num_tiles, qk_scale,
                      stride_q_token, stride_q_head, stride_o_token, stride_o_head,
                      BLOCK_M, BLOCK_N, HEAD_DIM, STAGES, NUM_WARPS, 0, ROWS_WG)),
                    (_load_partition,
                     (k_desc, v_desc, k_smem, v_smem, k_ready, v_ready, k_empty, v_empty,
                      block_table, seq_len, num_tiles, kv_row, oob_row,
                      NUM_KV_HEADS, BLOCK_SIZE, BLOCK_N, HEAD_DIM, STAGES, ROWS)),
                ],
                [LOAD_WARPS],
                [LOAD_REGS],
            )  # fmt: skip


def cache_descriptor(cache: torch.Tensor) -> TensorDescriptor:
    """A TMA descriptor over a head-major cache as [num_blocks * num_kv_heads * block_size,
    head_dim] rows, boxes of one page piece by 64 columns."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    rows = cache.transpose(1, 2).reshape(num_blocks * num_kv_heads * block_size, head_dim)
    return TensorDescriptor(rows, list(rows.shape), list(rows.stride()),
                            [piece_rows(block_size), _CHUNK], _chunk_layout())  # fmt: skip


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
) -> torch.Tensor:  # [num_tokens, num_heads, 128]
    """Causal attention for chunks whose earlier context is in the cache, where applies()."""
    num_tokens, num_heads, head_dim = query.shape
    assert num_heads % k_cache.shape[2] == 0 and k_cache.shape[3] == head_dim
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
