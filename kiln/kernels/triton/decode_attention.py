"""Paged decode attention, one query token per sequence (twin of reference.paged_decode_attention).

One program handles one (sequence, KV head) pair and all the query heads of that GQA group at once:
the group's heads are the M dimension of `tl.dot` (padded to 16), so each K/V tile is read from the
cache once per group instead of once per query head. Keys are visited BLOCK_N tokens at a time,
each token's slot found through the block table, with an online softmax in fp32.

Split-K (flash-decoding): when the batch alone would leave the GPU's multiprocessors underused,
each sequence's context is cut into up to `num_splits` partitions handled by separate programs;
each writes a partial output and its log-sum-exp, and a second small kernel merges them. The grid's
split count is the host's choice (from max_seq_len); each sequence's partition size is the device's,
from its own seq_len (`_partition`), so a CUDA graph captured at one context bucket stays right for
any shorter context, and buckets with the same split count share one graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.kv_layout import check_head_major
from kiln.kernels.triton._attention_kinds import kind_args
from kiln.kernels.triton._decode_partition import _mark_unused_split, _partition, _window_start
from kiln.kernels.triton._device import (
    dot_precision,
    fp16_dots,
    num_sms,
    output_like,
    unit_stride_rows,
)
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16
from kiln.kernels.triton._kv_layout import kv_head_offset, kv_tile_offsets
from kiln.kernels.triton._online_softmax import online_softmax_update, soft_cap
from kiln.kernels.triton.decode_attention_packed import _decode_packed_kernel, packing

_LOG2E = 1.4426950408889634

# Split-K policy (see choose_num_splits), measured on an H200 (132 SMs) at Llama-3.1-8B shapes:
# about 4 programs per SM is best (batch 32 x 8 KV heads: 2 splits beat 1 and 3; batch 64: 1), and
# partitions down to one 64-key tile still pay at batch 1 (1k context: 16 splits 7 us, 4 splits 12).
_TARGET_PROGRAMS_PER_SM = 4
_MIN_TOKENS_PER_SPLIT = 64
_MAX_SPLITS = 64


@triton.jit
def _tile_offsets(block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE):
    """Element offsets of keys n (one KV head's rows) in the paged cache, through the block
    table."""
    block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    return kv_tile_offsets(
        block_ids, n % BLOCK_SIZE, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE
    )


@triton.jit(do_not_specialize=["window"])
def _decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], head-major
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, head_dim] (written when not SPLIT)
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32 (written when SPLIT)
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain (written when SPLIT)
    qk_scale,  # softmax scale * log2(e): the softmax runs on exp2
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    num_splits,  # the grid's split count; each sequence uses as many as _partition says
    window,  # SLIDING: the query sees the last `window` keys
    softcap_in,  # SOFTCAP: scale / softcap
    softcap_out,  # SOFTCAP: softcap * log2(e)
    sinks_ptr,  # SINKS: [num_heads] fp32 logits that join each head's softmax denominator
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP padded to a power of two >= 16 (tl.dot's minimum M)
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_N: tl.constexpr,  # keys per tile
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,  # float8 cache, bf16 query: dots in fp16 (see _device.fp16_dots)
    PREFETCH_V: tl.constexpr,  # load V a tile ahead (float8 caches)
    HEADS_FIRST: tl.constexpr = False,  # grid (kv heads, sequences, splits): see _grid
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
    SINKS: tl.constexpr = False,
):
    if HEADS_FIRST:
        kv_head = tl.program_id(0)
        seq = tl.program_id(1)
    else:
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo, tile_lo = _window_start(seq_len, window, BLOCK_N, SLIDING)
    partition_size, num_valid = _partition(seq_len - tile_lo, num_splits, BLOCK_N)
    if SPLIT:  # noqa: SIM102 (resolved at compile time; the inner `if` is the device's)
        if split >= num_valid:
            _mark_unused_split(
                part_lse_ptr, seq, kv_head, split, num_splits, NUM_KV_HEADS, GROUP, GROUP_PAD
            )
            return
    start = tile_lo + split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, BLOCK_D)
    if BLOCK_D == HEAD_DIM:  # noqa: SIM108 (plain if/else: resolved at compile time)
        # A constant mask lets the compiler vectorise the loads along head_dim.
        dim_mask = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    if FP16_DOTS:
        q = q.to(tl.float16)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if SINKS:  # noqa: SIM102 (resolved at compile time)
        # The first partition counts the sink once: a key of weight exp(sink) and value 0.
        if split == 0:
            sink = tl.load(sinks_ptr + heads, mask=row_mask, other=float("-inf"))
            m_i = sink * 1.4426950408889634
            l_i = tl.where(row_mask, 1.0, 0.0)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head_offset(kv_head, HEAD_DIM, BLOCK_SIZE)
    # Every tile below holds at least one valid key (n_start < end): its row maxima are finite.
    if PREFETCH_V:
        # Float8 cache: V's raw bytes for the next tile are loaded one iteration ahead. V is
        # widened by inline asm right after its load (see _fp8.py), which keeps Triton from
        # pipelining that load through shared memory as it does K's; issued a tile early, its
        # latency overlaps this tile's dots instead of stalling them.
        n = start + offs_n
        n_mask = n < end
        if SLIDING:  # keys before the window: blocks that may be another request's by now
            n_mask = n_mask & (n >= lo)
        kv_mask = n_mask[:, None] & dim_mask[None, :]
        v_offsets = _tile_offsets(
            block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE
        )
        v_raw = tl.load(v_cache_ptr + v_offsets, mask=kv_mask, other=0.0)
        for n_start in range(start, end, BLOCK_N):
            n = n_start + offs_n
            n_mask = n < end
            if SLIDING:
                n_mask = n_mask & (n >= lo)
            kv_offsets = _tile_offsets(
                block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE
            )
            k = tl.load(
                k_cache_ptr + kv_offsets, mask=n_mask[:, None] & dim_mask[None, :], other=0.0
            )
            next_n = n + BLOCK_N
            next_mask = next_n < end
            next_offsets = _tile_offsets(
                block_table, next_n, next_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM,
                BLOCK_SIZE,
            )  # fmt: skip
            next_v_raw = tl.load(
                v_cache_ptr + next_offsets, mask=next_mask[:, None] & dim_mask[None, :], other=0.0
            )
            if FP16_DOTS:  # noqa: SIM108 (resolved at compile time)
                v = fp8e4m3_to_fp16(v_raw)  # not v.to(tl.float16): see _fp8.py
            else:
                v = v_raw.to(q.dtype)
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
            if SOFTCAP:  # noqa: SIM108 (resolved at compile time)
                s = soft_cap(s, softcap_in, softcap_out)
            else:
                s = s * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
            acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, 1.0, v, DOT_PRECISION)
            v_raw = next_v_raw
    else:
        for n_start in range(start, end, BLOCK_N):
            n = n_start + offs_n
            n_mask = n < end
            if SLIDING:
                n_mask = n_mask & (n >= lo)
            kv_offsets = _tile_offsets(
                block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE
            )
            kv_mask = n_mask[:, None] & dim_mask[None, :]
            k = tl.load(k_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_cache_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            if SOFTCAP:  # noqa: SIM108 (resolved at compile time)
                s = soft_cap(s, softcap_in, softcap_out)
            else:
                s = s * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_N]
            acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, 1.0, v, DOT_PRECISION)

    # Only an empty context (seq_len 0, unsplit) leaves l_i == 0: it writes zeros.
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    out_mask = row_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_index = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        tl.store(part_lse_ptr + part_index, lse, mask=row_mask)
        tl.store(part_out_ptr + part_index[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
    else:
        tl.store(
            out_ptr
            + seq.to(tl.int64) * stride_o_seq
            + heads[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


# The split count is not specialized on (Triton would otherwise compile one variant for counts
# that divide by 16 and one for the rest, per SPLITS_PAD). CUDA-graph capture compiles the counts
# its buckets choose (powers of two: 4, 8 / 16, 32, 64), while an eager mixed step chooses from the
# batch's own longest context (e.g. 11 splits for one decode at 700 tokens beside a prefill), and
# each such count would compile a variant mid-run, stalling every request. The kernel only
# indexes with it.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] fp32
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 domain
    out_ptr,  # [num_seqs, num_heads, head_dim]
    stride_o_seq,
    stride_o_head,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merges one (sequence, head)'s partial outputs: weights exp2(lse_i - max lse). A slot
    past the sequence's last partition holds -inf (the decode kernels write it): weight 0, its
    stale output never read into the sum. So no load waits for seq_len first."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    base = (seq.to(tl.int64) * NUM_HEADS + head) * num_splits
    lse = tl.load(part_lse_ptr + base + splits, mask=split_mask, other=float("-inf"))
    parts = tl.load(
        part_out_ptr + (base + splits)[:, None] * HEAD_DIM + dims[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    lse_max = tl.max(lse, 0)
    used = lse > float("-inf")
    weights = tl.where(used, tl.exp2(lse - lse_max), 0.0)
    total = tl.sum(weights, 0)
    terms = tl.where(used[:, None], weights[:, None] * parts, 0.0)
    out = tl.sum(terms, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq.to(tl.int64) * stride_o_seq + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many partitions to cut each context into.

    Without splitting there are num_seqs * num_kv_heads programs. Multiply them up to (not past)
    _TARGET_PROGRAMS_PER_SM programs per SM, never into partitions shorter than
    _MIN_TOKENS_PER_SPLIT tokens (their merge and fixed costs would outweigh the parallelism).
    Past one wave of that many (a large batch), long contexts split until the last wave is
    nearly full (_long_context_splits). Depends only on host ints, so it never synchronises with
    the GPU; never falls as max_seq_len grows.
    """
    programs = num_seqs * num_kv_heads
    slots = _TARGET_PROGRAMS_PER_SM * num_sms
    if programs > slots:
        return _long_context_splits(programs, slots, max_seq_len)
    wanted = slots // max(programs, 1)
    useful = triton.cdiv(max_seq_len, _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, _MAX_SPLITS))


# Past one wave, a split costs a partial output and its merge (4 KB a query-head group) against
# partitions of at least this many keys (256 KB of float8 K/V at Llama's shapes): under 2%.
_LONG_MIN_TOKENS_PER_SPLIT = 1024
_MIN_WAVE_FILL = 0.9


def _long_context_splits(programs: int, slots: int, max_seq_len: int) -> int:
    """The fewest splits whose programs fill their last wave of `slots` to _MIN_WAVE_FILL.

    Equal programs run in waves: 84 sequences x 8 KV heads at 21k tokens (the 20000/2000 row)
    are 672 programs, 1.27 waves of 528 on an H200, so the second wave runs a quarter full and
    the step reads at ~64% of what full waves would (measured: 55-60% of the copy bandwidth);
    cut in 3, they are 2016 programs, 95% of 4 waves. Partitions stay at least
    _LONG_MIN_TOKENS_PER_SPLIT keys, so short contexts keep one split."""
    cap = min(max_seq_len // _LONG_MIN_TOKENS_PER_SPLIT, _MAX_SPLITS)
    splits = 1
    while splits < cap:
        total = programs * splits
        if total / (triton.cdiv(total, slots) * slots) >= _MIN_WAVE_FILL:
            break
        splits += 1
    return splits


# A float8 cache's decode kernel at many programs runs one-warp programs over 32-key tiles: its
# four-warp program holds 128 registers a thread (V is loaded a tile ahead), so an SM keeps only
# 4 programs and too few loads in flight; one warp of 32 keys was 9-10% faster on an H200 at 3072
# and 4096 programs (384 x 1.5k, 512 x 192) and 35% slower at 512 (64 x 4k), where it leaves SMs
# idle.
_FP8_ONE_WARP_PROGRAMS_PER_SM = 12


def _tile_config(
    block_size: int,
    device: torch.device,
    kv_fp8: bool = False,
    programs: int = 0,
    head_dim: int = 128,
) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages); `programs` is the grid's size (sequences x KV heads x
    splits), a host int."""
    if device.type != "cuda":
        return 16, 4, 1  # the interpreter's cost grows with tile size; 16 is tl.dot's minimum
    if head_dim > 256:
        # MLA's 576-wide latent rows (1024-wide tiles): the interpreter's tiles, one stage, so
        # K and V tiles fit shared memory; untimed, and not yet compiled on a GPU.
        return 16, 8, 1
    if kv_fp8:
        if programs and programs >= _FP8_ONE_WARP_PROGRAMS_PER_SM * num_sms(device):
            return 32, 1, 2
        # Float8 K/V (V widened by _fp8.fp8e4m3_to_fp16, loaded a tile ahead): 64 keys, 4 warps,
        # 2 stages were best of 18 tiles on an H200 at 384 x 1.5k and 64 x 4k, within 10% at
        # batch 1.
        return 64, 4, 2
    # Tiles of whole cache blocks (or whole tiles of one block), at least 64 keys per tile.
    # 64 keys, 4 warps, 3 stages was within 1-3% of the best of {32,64,128} x {2,4,8} x {2,3} at
    # every H200 decode shape measured (batch 1-128, context 1k-32k).
    return max(64, min(block_size, 128)), 4, 3


# Rows of 256 dims (Gemma-2/3) outgrow head_dim 128's packed tiles: compiled for sm_90a those
# spill 228-500 bytes a thread and take 153 KiB of shared memory (one two-warp program an
# SM), while four warps of 16-key sub-tiles spill nothing in 81 KiB, two programs an SM each
# streaming 32 KiB of K an iteration as head_dim 128's do (at 512 dims 128's tiles need 305 KiB,
# more than an H100 has; these 161). Untimed: benchmarks/kernels_gpu.py --only decode256.
_WIDE_HEAD_DIM = 256
_WIDE_PACKED_TILE = (16, 4, 2)


def _packed_tile_config(
    block_size: int, device: torch.device, programs: int = 0, head_dim: int = 128
) -> tuple[int, int, int]:
    """The packed kernel's (BLOCK_N keys per sub-tile, num_warps, num_stages); `programs` is the
    grid's size. Best of 18 tiles on an H200 at each shape: one warp of 16-key sub-tiles where
    the grid fills the SMs many times over (768 / 384 x 1.5k, 512 x 192), two warps of 32 at a
    few programs an SM (64 x 4k, 32 x 1k: 512 programs), four warps of 16 below (batch 1).
    Rows of _WIDE_HEAD_DIM and more take _WIDE_PACKED_TILE at every grid size."""
    if device.type != "cuda":
        return 16, 4, 1
    if head_dim >= _WIDE_HEAD_DIM:
        return _WIDE_PACKED_TILE
    sms = num_sms(device)
    if programs >= _FP8_ONE_WARP_PROGRAMS_PER_SM * sms:
        return 16, 1, 2
    if programs >= 2 * sms:
        return 32, 2, 2
    return 16, 4, 2


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # written and returned when given (a slice of a larger one)
    window: int | None = None,  # sliding window: only the last `window` keys (itself included)
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32 learned logits in the denominator
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Each query attends to its sequence's first seq_lens[i] cached tokens (itself included),
    or the last `window` of them. max_seq_len (an upper bound of seq_lens) only sets the grid's
    split count (from at most `window` keys)."""
    keys = max_seq_len if window is None else min(max_seq_len, window)
    num_splits = choose_num_splits(query.shape[0], k_cache.shape[2], keys, num_sms(query.device))
    return paged_decode_attention_splits(
        query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, num_splits, out,
        window, softcap, sinks,
    )  # fmt: skip


def paged_decode_attention_splits(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    num_splits: int,
    out: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """paged_decode_attention with an explicit grid split count (1 = no split-K): each sequence
    uses up to num_splits partitions of whole tiles, sized from its own length (from its
    window's first tile, with a window)."""
    kinds = kind_args(query, scale, window, softcap, sinks)
    flags = {"SLIDING": window is not None, "SOFTCAP": softcap is not None}
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_heads % num_kv_heads == 0 and k_cache.shape[3] == head_dim
    check_head_major(k_cache, v_cache)
    out = output_like(query, out)
    if num_seqs == 0:
        return out
    query, block_tables = unit_stride_rows(query, block_tables)
    group = num_heads // num_kv_heads
    # float8 or int8: one byte a value, the same tiles and kernels (int8's timed on no GPU yet).
    kv_fp8 = k_cache.element_size() == 1
    # The grid's split count is taken as given (not trimmed to what max_seq_len can use): each
    # sequence's partitions depend on its own length and this count only, so a graph replay and
    # an eager step with the same count compute the same partitions; splits a sequence cannot
    # use exit at once.
    num_splits = max(num_splits, 1)
    # Over a float8 cache the packed kernel wherever the group packs: 1.27-1.36x the unpacked
    # one on an H200 at 768 x 1.5k, 384 x 1.5k and 512 x 192.
    # (Sinks take the unpacked kernel: its rows are query heads, the packed one's are not.)
    if kv_fp8 and sinks is None and (pack := packing(group, head_dim)):
        return _packed_decode(
            query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out, pack,
            kinds, flags,
        )  # fmt: skip
    # A sequence's KV heads as neighbouring programs over 16- and 32-bit caches, one head of
    # neighbouring sequences over float8 ones: heads first ran a bf16 cache 10-14% faster a layer
    # on an H200 (384 x 1.5k, 512 x 192, 64 x 4k) and a float8 one 36-48% slower (64 x 4k, 32 x 1k).
    heads_first = not kv_fp8
    block_n, num_warps, num_stages = _tile_config(
        block_size, query.device, kv_fp8, num_seqs * num_kv_heads * num_splits, head_dim
    )
    split = num_splits > 1
    # Unsplit, the kernel writes `out` directly and never touches the partial buffers.
    part_out, part_lse = _split_buffers(query, num_splits) if split else (out, out)
    block_d = triton.next_power_of_2(head_dim)
    grid = _grid(num_seqs, num_kv_heads, num_splits, heads_first)
    _decode_kernel[grid](
        *_pointer_args(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            part_out,
            part_lse,
            scale,
            num_splits,
        ),
        *kinds,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype),
        FP16_DOTS=fp16_dots(query, k_cache),
        PREFETCH_V=kv_fp8,
        HEADS_FIRST=heads_first,
        SINKS=sinks is not None,
        **flags,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _reduce(part_out, part_lse, out, num_splits)
    return out


def _grid(num_seqs: int, num_kv_heads: int, num_splits: int, heads_first: bool) -> tuple:
    """Both decode kernels' grid: (kv heads, sequences, splits) heads first, else (sequences, kv
    heads, splits)."""
    if heads_first:
        return (num_kv_heads, num_seqs, num_splits)
    return (num_seqs, num_kv_heads, num_splits)


def _pointer_args(
    query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse, scale, num_splits
) -> tuple:
    """The positional arguments both decode kernels take, in their order."""
    return (
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), num_splits,
    )  # fmt: skip


def _split_buffers(query: torch.Tensor, num_splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_seqs, num_heads, head_dim = query.shape
    part_out = torch.empty(
        (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
    )
    part_lse = torch.empty(
        (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
    )
    return part_out, part_lse


def _reduce(part_out, part_lse, out, num_splits: int) -> None:
    """Merges the splits' partial outputs into `out`."""
    num_seqs, num_heads, head_dim = out.shape
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        NUM_HEADS=num_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4,
    )


def _packed_decode(
    query, k_cache, v_cache, block_tables, seq_lens, scale, num_splits, out, pack, kinds, flags
) -> torch.Tensor:
    """paged_decode_attention_splits through decode_attention_packed's kernel."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    block_n, num_warps, num_stages = _packed_tile_config(
        block_size, query.device, num_seqs * num_kv_heads * num_splits, head_dim
    )
    split = num_splits > 1
    part_out, part_lse = _split_buffers(query, num_splits) if split else (out, out)
    grid = _grid(num_seqs, num_kv_heads, num_splits, heads_first=False)
    _decode_packed_kernel[grid](
        *_pointer_args(
            query,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            out,
            part_out,
            part_lse,
            scale,
            num_splits,
        ),
        *kinds[:3],
        NUM_KV_HEADS=num_kv_heads,
        GROUP=num_heads // num_kv_heads,
        PACK=pack,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype),
        FP16_DOTS=fp16_dots(query, k_cache),
        **flags,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _reduce(part_out, part_lse, out, num_splits)
    return out
