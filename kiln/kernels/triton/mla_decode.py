"""Multi-head latent attention decode over the paged cache (twin of
reference.mla_decode_attention): one query token per sequence, every query head attending to
the sequence's cached rows [k_pe | c_kv] (one KV head), the output the attended latent only.

One program takes BLOCK_H query heads of one sequence (the M dimension of tl.dot) and a
partition of its keys; each row is read once, its rotary and latent dims as two tiles, scores
q_pe . k_pe + q_lat . c_kv, then the weights times the latent tile (the rows' rotary dims are
never a value, where the shared decode kernel reads every row twice, as K and as V, 1024-wide
padded). Split-K as the shared kernel: the host picks the split count, each sequence's
partition comes from its own seq_len on the device, so a CUDA graph captured at a context
bucket's bound stays right below it; the shared kernel's merge (its head_dim the latent
width) merges the partitions by their log-sum-exp. A float8 (e4m3, unscaled) cache's tiles
are widened to the query's dtype in registers right after their load (exact: every e4m3 value
is a bf16 and an fp16 one), the dots in that dtype as over a 16-bit cache; an int8 cache is
refused (the latent rows take no int8 scales: reference.check_mla_cache)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.reference import check_mla_cache
from kiln.kernels.triton._device import dot_precision, num_sms, unit_stride_rows
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16
from kiln.kernels.triton.decode_attention import _reduce

_LOG2E = 1.4426950408889634
_BLOCK_H = 16  # tl.dot's smallest M
_MAX_SPLITS = 32
_TARGET_PROGRAMS_PER_SM = 2
_MIN_KEYS_PER_SPLIT = 64


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, ROPE + LORA]
    cache_ptr,  # [num_blocks, block_size, 1, ROPE + LORA] (one KV head: rows contiguous)
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, LORA] (written unsplit)
    part_out_ptr,  # [num_seqs, num_heads, num_splits, LORA] fp32 (written split)
    part_lse_ptr,  # [num_seqs, num_heads, num_splits] fp32, log2 units
    scale_log2,  # the softmax scale times log2(e)
    stride_q_seq,
    stride_q_head,
    stride_bt_seq,
    stride_o_seq,
    stride_o_head,
    num_heads,
    num_splits,
    ROPE: tl.constexpr,
    LORA: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    LORA_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the cache's
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    CACHE_FP8: tl.constexpr = False,  # float8 e4m3 rows, widened to the query's dtype
    ASM_WIDEN: tl.constexpr = False,  # CACHE_FP8 on a GPU: through _fp8.fp8e4m3_to_fp16
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.cdiv(tiles, num_splits)
    start = split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < num_heads
    r = tl.arange(0, ROPE_PAD)
    c = tl.arange(0, LORA_PAD)
    r_mask, c_mask = r < ROPE, c < LORA
    q_rows = q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head
    q_pe = tl.load(q_rows + r[None, :], mask=head_mask[:, None] & r_mask[None, :], other=0.0)
    q_lat = tl.load(
        q_rows + ROPE + c[None, :], mask=head_mask[:, None] & c_mask[None, :], other=0.0
    )

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LORA_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + seq * stride_bt_seq
    for n_start in range(start, end, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)
        n_mask = n < end
        block_ids = tl.load(block_table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = cache_ptr + (block_ids * BLOCK_SIZE + n % BLOCK_SIZE) * (ROPE + LORA)
        k_pe = tl.load(rows[:, None] + r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                       other=0.0)  # fmt: skip
        latent = tl.load(rows[:, None] + ROPE + c[None, :],
                         mask=n_mask[:, None] & c_mask[None, :], other=0.0)  # fmt: skip
        if ASM_WIDEN:
            # Widened in registers off the load: a plain .to() keeps the tile 8-bit in shared
            # memory and reads it back a byte at a time for the transposed dot, converting it
            # twice (255 registers a thread against 184 this way, compiled for sm_90).
            k_pe = fp8e4m3_to_fp16(k_pe).to(q_pe.dtype)
            latent = fp8e4m3_to_fp16(latent).to(q_lat.dtype)
        elif CACHE_FP8:  # the interpreter's (it runs no inline asm)
            k_pe = k_pe.to(q_pe.dtype)
            latent = latent.to(q_lat.dtype)
        scores = tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        scores += tl.dot(q_lat, tl.trans(latent), input_precision=DOT_PRECISION)
        scores = tl.where(n_mask[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(
            p.to(latent.dtype), latent, input_precision=DOT_PRECISION
        )
        m_i = m_new
    # A partition with no keys (or a padding row) has l_i 0: its output 0, its weight 0 below.
    safe_l = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc / safe_l[:, None]
    mask = head_mask[:, None] & c_mask[None, :]
    if SPLIT:
        part = (seq * num_heads + heads) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * LORA + c[None, :], out, mask=mask)
        lse = tl.where(l_i > 0.0, m_i + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_mask)
    else:
        dst = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + c[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=mask)


def choose_mla_splits(num_seqs: int, num_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Partitions of each sequence's keys: enough programs for about two a multiprocessor,
    none shorter than _MIN_KEYS_PER_SPLIT of the longest context; 1 once the batch fills the
    device. Any count computes the same (each partition is cut from its sequence's own length
    on the device), so a CUDA graph keeps the count of the bound it was captured at. Untimed
    on a GPU."""
    programs = num_seqs * triton.cdiv(num_heads, _BLOCK_H)
    want = _TARGET_PROGRAMS_PER_SM * num_sms(device) // max(programs, 1)
    return max(1, min(_MAX_SPLITS, want, triton.cdiv(max_seq_len, _MIN_KEYS_PER_SPLIT)))


def mla_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, rope + lora], one query token per sequence
    cache: torch.Tensor,  # [num_blocks, block_size, 1, rope + lora]: the rows, K and V both
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    max_seq_len: int,
    rope_dim: int,
    num_splits: int | None = None,  # None: choose_mla_splits
) -> torch.Tensor:  # [num_seqs, num_heads, lora]: the attended latent
    num_seqs, num_heads, width = query.shape
    check_mla_cache(query, cache)
    assert cache.shape[2:] == (1, width), "one KV head of rows"
    assert cache.transpose(1, 2).is_contiguous(), "a head-major cache (kv_layout.empty_cache)"
    lora = width - rope_dim
    out = torch.empty(num_seqs, num_heads, lora, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    query, block_tables = unit_stride_rows(query, block_tables)
    splits = num_splits or choose_mla_splits(num_seqs, num_heads, max_seq_len, query.device)
    split = splits > 1
    part_out = part_lse = out
    if split:
        part_out = torch.empty(num_seqs, num_heads, splits, lora, dtype=torch.float32,
                               device=query.device)  # fmt: skip
        part_lse = torch.empty(num_seqs, num_heads, splits, dtype=torch.float32,
                               device=query.device)  # fmt: skip
    interpreted = query.device.type != "cuda"
    fp8 = cache.dtype == torch.float8_e4m3fn
    # Untimed on a GPU: 32 keys, 4 warps, 2 stages hold a 32 x 512 latent tile a stage.
    block_n, num_warps, num_stages = (16, 4, 1) if interpreted else (32, 4, 2)
    grid = (num_seqs, triton.cdiv(num_heads, _BLOCK_H), splits)
    _mla_decode_kernel[grid](
        query, cache, block_tables, seq_lens, out, part_out, part_lse, scale * _LOG2E,
        query.stride(0), query.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        num_heads, splits,
        ROPE=rope_dim,
        LORA=lora,
        ROPE_PAD=max(16, triton.next_power_of_2(rope_dim)),
        LORA_PAD=max(16, triton.next_power_of_2(lora)),
        BLOCK_SIZE=cache.shape[1],
        BLOCK_H=_BLOCK_H,
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_PRECISION=dot_precision(query.dtype),
        CACHE_FP8=fp8,
        ASM_WIDEN=fp8 and not interpreted,
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    if split:
        _reduce(part_out, part_lse, out, splits)
    return out
