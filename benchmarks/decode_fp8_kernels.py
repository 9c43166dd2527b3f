"""Experimental decode-attention kernels over a float8 cache, measured on the H200 and not used by
the engine (benchmarks/decode_fp8_dots_sweep.py; results/2026-12-02-h200-fp8-decode-tiles/): float8
tensor-core dots (2x slower than the engine's kernel), and the engine's kernel with its float8 ->
fp16 widening done by integer bits or not at all (the conversions cost 2.5%).

Why: the decode kernel of decode_attention.py widens float8 K and V to fp16 before its dots, at
one query token padded to 16 rows (mma.sync). On an H200 it reads a float8 cache at ~2.5 TB/s
against the 4.3 of a bf16 cache (docs/performance.md, "FP8 KV cache"): per tile the widening, the
V transpose through shared memory and the padded rows cost more issue slots than the bytes take to
arrive. Hopper's wgmma multiplies float8 operands directly, but only at 64 rows or more, so this
kernel puts 64 rows where they exist:

- ORIENT "swap": keys are the rows. S^T = K @ Q^T ([BLOCK_N keys, GROUP_PAD]) and
  O^T = V^T @ P^T ([head_dim, GROUP_PAD]): the query group is the small N of the dots (16), and the
  softmax runs along the keys (axis 0).
- ORIENT "pad": the query group padded to 64 rows (the plain orientation, 16x the softmax work).

The query is quantized to float8 per head (scale amax/448) and the probabilities as p * 256 (the
tile's maximum becomes 256, so weights down to 2^-17 of it survive instead of 2^-9), which the
final division takes back. (No PyTorch twin: not a product kernel.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.triton._decode_partition import _mark_unused_split, _partition
from kiln.kernels.triton._device import num_sms, output_like
from kiln.kernels.triton._fp8 import fp8e4m3_to_fp16
from kiln.kernels.triton._online_softmax import online_softmax_update
from kiln.kernels.triton.decode_attention import (
    _LOG2E,
    _reduce,
    _tile_offsets,
    choose_num_splits,
)


@triton.jit
def fp8e4m3_to_fp16_div256(x, PURE: tl.constexpr):
    # The same widening by integer operations instead of cvt: an e4m3 byte's sign and its
    # exponent+mantissa bits moved into fp16's places give value / 256 exactly (the exponent
    # biases differ by 8), subnormals included. Two byte permutes spread four bytes into two
    # (0, b, 0, b) words; shifts and masks place the bits.
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t0, t1, s0, s1, u0, u1;
        prmt.b32 t0, $2, 0, 0x4140;
        prmt.b32 t1, $2, 0, 0x4342;
        shl.b32 s0, t0, 8;
        shl.b32 u0, t0, 7;
        and.b32 s0, s0, 0x80008000;
        and.b32 u0, u0, 0x3f803f80;
        or.b32 $0, s0, u0;
        shl.b32 s1, t1, 8;
        shl.b32 u1, t1, 7;
        and.b32 s1, s1, 0x80008000;
        and.b32 u1, u1, 0x3f803f80;
        or.b32 $1, s1, u1;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=PURE,
        pack=4,
    )


@triton.jit
def fp8e4m3_no_widening(x, PURE: tl.constexpr):
    # Timing only (wrong values): the raw bytes handed on as fp16 registers, no conversion work.
    return tl.inline_asm_elementwise(
        asm="mov.b32 $0, $2; mov.b32 $1, $2;",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.float16,
        is_pure=PURE,
        pack=4,
    )


_FP8_MAX = 448.0
_P_SCALE = 256.0  # probabilities enter the P @ V dot as p * 256 (see the module docstring)


@triton.jit
def _decode_fp8_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] float8, contiguous
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,  # softmax scale * log2(e)
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # 16 for "swap", 64 for "pad"
    HEAD_DIM: tl.constexpr,  # a power of two (the dots take whole head_dim tiles)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    SWAP: tl.constexpr,  # True: ORIENT "swap"; False: "pad"
    Q_FP8: tl.constexpr,  # the query quantized to float8 (else Q @ K^T in fp16, K widened)
    TWO_TERMS: tl.constexpr,  # float8 operands as a value plus its rounding error (2 dots each)
    FP8_MAX: tl.constexpr,
    P_SCALE: tl.constexpr,
    PV_FP16: tl.constexpr = False,  # P @ V in fp16, V widened by _fp8.py's cvt (swap only)
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_size, num_valid = _partition(seq_len, num_splits, BLOCK_N)
    if SPLIT:  # noqa: SIM102
        if split >= num_valid:
            _mark_unused_split(
                part_lse_ptr, seq, kv_head, split, num_splits, NUM_KV_HEADS, GROUP, GROUP_PAD
            )
            return
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)

    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    ).to(tl.float32)
    if Q_FP8:
        q_amax = tl.max(tl.abs(q), 1)
        q_scale = tl.where(q_amax > 0.0, q_amax / FP8_MAX, 1.0)
        q_unit = q / q_scale[:, None]
        qd = q_unit.to(tl.float8e4nv)
        # The rounding error, x16 (it is at most half a float8 step of the value), in float8 too.
        q_lo = ((q_unit - qd.to(tl.float32)) * 16.0).to(tl.float8e4nv)
        row_scale = q_scale * qk_scale  # [GROUP_PAD]: a score is dot(qd, k) * row_scale
    else:
        qd = q.to(tl.float16)
        q_lo = qd
        row_scale = tl.full([GROUP_PAD], 1.0, tl.float32) * qk_scale

    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head * HEAD_DIM
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if SWAP:
        acc = tl.zeros([HEAD_DIM, GROUP_PAD], dtype=tl.float32)  # O^T
    else:
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for n_start in range(start, end, BLOCK_N):
        n = n_start + offs_n
        n_mask = n < end
        offsets = _tile_offsets(
            block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, False
        )
        k = tl.load(k_cache_ptr + offsets, mask=n_mask[:, None], other=0.0)
        if not Q_FP8:
            k = k.to(tl.float16)
        v = tl.load(v_cache_ptr + offsets, mask=n_mask[:, None], other=0.0)
        if SWAP:
            s = tl.dot(k, tl.trans(qd))
            if TWO_TERMS and Q_FP8:
                s += tl.dot(k, tl.trans(q_lo)) * 0.0625
            s = s * row_scale[None, :]  # [BLOCK_N, GROUP_PAD]
            s = tl.where(n_mask[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            p_scaled = p * P_SCALE
            if PV_FP16:
                v16 = fp8e4m3_to_fp16(v)
                acc = tl.dot(tl.trans(v16), p_scaled.to(tl.float16), acc * alpha[None, :])
            else:
                p8 = p_scaled.to(tl.float8e4nv)
                acc = tl.dot(tl.trans(v), p8, acc * alpha[None, :])
            if TWO_TERMS and not PV_FP16:
                p_lo = ((p_scaled - p8.to(tl.float32)) * 16.0).to(tl.float8e4nv)
                acc += tl.dot(tl.trans(v), p_lo) * 0.0625
        else:
            s = tl.dot(qd, tl.trans(k))
            if TWO_TERMS and Q_FP8:
                s += tl.dot(q_lo, tl.trans(k)) * 0.0625
            s = s * row_scale[:, None]  # [GROUP_PAD, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p_scaled = p * P_SCALE
            p8 = p_scaled.to(tl.float8e4nv)
            acc = tl.dot(p8, v, acc * alpha[:, None])
            if TWO_TERMS:
                p_lo = ((p_scaled - p8.to(tl.float32)) * 16.0).to(tl.float8e4nv)
                acc += tl.dot(p_lo, v) * 0.0625
        m_i = m_new

    nonempty = l_i > 0.0
    inv = 1.0 / (tl.where(nonempty, l_i, 1.0) * P_SCALE)
    if SWAP:
        out = acc * inv[None, :]  # [HEAD_DIM, GROUP_PAD]
        out_mask = row_mask[None, :]
        head_index = heads[None, :]
        dim_index = dims[:, None]
    else:
        out = acc * inv[:, None]
        out_mask = row_mask[:, None]
        head_index = heads[:, None]
        dim_index = dims[None, :]
    if SPLIT:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_rows = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        tl.store(part_lse_ptr + part_rows, lse, mask=row_mask)
        if SWAP:
            part_index = part_rows[None, :] * HEAD_DIM + dim_index
        else:
            part_index = part_rows[:, None] * HEAD_DIM + dim_index
        tl.store(part_out_ptr + part_index, out, mask=out_mask)
    else:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_o_seq + head_index * stride_o_head + dim_index,
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


def paged_decode_attention_fp8_dots(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    *,
    num_splits: int | None = None,
    orient: str = "swap",
    q_fp8: bool = True,
    two_terms: bool = False,
    pv_fp16: bool = False,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """paged_decode_attention over a float8_e4m3fn cache with float8 dots (see the module)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert k_cache.dtype == torch.float8_e4m3fn and v_cache.dtype == torch.float8_e4m3fn
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16
    out = output_like(query, out)
    if num_seqs == 0:
        return out
    if query.stride(2) != 1:
        query = query.contiguous()
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(query.device))
    num_splits = max(num_splits, 1)
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out
    group = num_heads // num_kv_heads
    swap = orient == "swap"
    group_pad = max(16 if swap else 64, triton.next_power_of_2(group))
    _decode_fp8_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        num_splits,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        SPLIT=split,
        SWAP=swap,
        Q_FP8=q_fp8,
        TWO_TERMS=two_terms,
        FP8_MAX=_FP8_MAX,
        P_SCALE=_P_SCALE,
        PV_FP16=pv_fp16,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if split:
        _reduce(part_out, part_lse, out, num_splits)
    return out


@triton.jit
def _widen(x, MODE: tl.constexpr, PURE: tl.constexpr):
    """float8 -> fp16 by MODE: 0 cvt (today), 1 integer bits (value / 256), 2 none (timing)."""
    if MODE == 0:
        return fp8e4m3_to_fp16(x)
    elif MODE == 1:
        return fp8e4m3_to_fp16_div256(x, PURE)
    else:
        return fp8e4m3_no_widening(x, PURE)


@triton.jit
def _decode_widen_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    stride_q_seq,
    stride_q_head,
    stride_o_seq,
    stride_o_head,
    stride_bt_seq,
    num_splits,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    K_WIDEN: tl.constexpr,  # -1: Triton's .to(fp16) (today); else _widen's MODE, pure
    V_WIDEN: tl.constexpr,  # _widen's MODE right after the load (today: 0)
):
    """decode_attention._decode_kernel's float8 prefetch path with the widening chosen."""
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    partition_size, num_valid = _partition(seq_len, num_splits, BLOCK_N)
    if SPLIT:  # noqa: SIM102
        if split >= num_valid:
            _mark_unused_split(
                part_lse_ptr, seq, kv_head, split, num_splits, NUM_KV_HEADS, GROUP, GROUP_PAD
            )
            return
    start = split * partition_size
    end = tl.minimum(start + partition_size, seq_len)
    rows = tl.arange(0, GROUP_PAD)
    row_mask = rows < GROUP
    heads = kv_head * GROUP + rows
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :],
        mask=row_mask[:, None],
        other=0.0,
    ).to(tl.float16)
    if K_WIDEN == 1:
        qk_scale = qk_scale * 256.0  # the keys arrive as value / 256
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head * HEAD_DIM
    n = start + offs_n
    n_mask = n < end
    v_offsets = _tile_offsets(
        block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, False
    )
    v_raw = tl.load(v_cache_ptr + v_offsets, mask=n_mask[:, None], other=0.0)
    for n_start in range(start, end, BLOCK_N):
        n = n_start + offs_n
        n_mask = n < end
        kv_offsets = _tile_offsets(
            block_table, n, n_mask, head_offset, dims, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, False
        )
        k_raw = tl.load(k_cache_ptr + kv_offsets, mask=n_mask[:, None], other=0.0)
        next_n = n + BLOCK_N
        next_mask = next_n < end
        next_offsets = _tile_offsets(
            block_table,
            next_n,
            next_mask,
            head_offset,
            dims,
            NUM_KV_HEADS,
            HEAD_DIM,
            BLOCK_SIZE,
            False,
        )
        next_v_raw = tl.load(v_cache_ptr + next_offsets, mask=next_mask[:, None], other=0.0)
        v = _widen(v_raw, V_WIDEN, False)
        if K_WIDEN < 0:  # noqa: SIM108
            k = k_raw.to(tl.float16)
        else:
            k = _widen(k_raw, K_WIDEN, True)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        acc, l_i, m_i = online_softmax_update(acc, l_i, m_i, s, v, "ieee")
        v_raw = next_v_raw
    nonempty = l_i > 0.0
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    if V_WIDEN == 1:
        out = out * 256.0  # the values arrived as value / 256
    out_mask = row_mask[:, None]
    if SPLIT:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        part_index = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
        tl.store(part_lse_ptr + part_index, lse, mask=row_mask)
        tl.store(part_out_ptr + part_index[:, None] * HEAD_DIM + dims[None, :], out, mask=out_mask)
    else:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_o_seq + heads[:, None] * stride_o_head
            + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )  # fmt: skip


def paged_decode_attention_widen(
    query, k_cache, v_cache, block_tables, seq_lens, scale, max_seq_len, *,
    k_widen: int = -1, v_widen: int = 0, block_n: int = 64, num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:  # fmt: skip
    """Today's float8 decode (fp16 dots, V a tile ahead) with the widening modes chosen."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(query)
    num_splits = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms(query.device))
    split = num_splits > 1
    if split:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out
    group = num_heads // num_kv_heads
    _decode_widen_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale * _LOG2E, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), num_splits,
        NUM_KV_HEADS=num_kv_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split,
        K_WIDEN=k_widen, V_WIDEN=v_widen, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    if split:
        _reduce(part_out, part_lse, out, num_splits)
    return out
