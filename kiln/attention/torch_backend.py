"""Pure-PyTorch attention over the paged KV cache: the reference backend, used on the CPU."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
)
from kiln.kernels import reference


class PagedAttentionBackend(AttentionBackend):
    """Attends with `ops`' decode and prefill kernels. Backends differ only in their `ops` module
    (the kernel twins share one signature) and in whether prefill over a float8 cache runs its
    Q.K dots in float8 (`fp8_qk`, reference.uses_fp8_qk)."""

    ops: ModuleType
    fp8_qk: bool = False

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kind: AttentionKind = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return run_split_attention(
            self.ops, query, k_cache, v_cache, metadata, scale, kind, sinks, self.fp8_qk
        )


class TorchAttentionBackend(PagedAttentionBackend):
    """The reference: prefill over a float8 cache widens K and V (the CPU has no float8
    arithmetic to gain from)."""

    name = "torch"
    ops = reference


def run_split_attention(
    ops,  # a module exposing paged_decode_attention and paged_prefill_attention
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    kind: AttentionKind = FULL_ATTENTION,
    sinks: torch.Tensor | None = None,
    fp8_qk: bool = False,
) -> torch.Tensor:
    """Decodes (the first `num_decodes` sequences, one token each) go through the decode kernel,
    the remaining prefill chunks through the prefill kernel; shared by every backend."""
    m = metadata
    nd = m.num_decodes
    # Only a layer of another kind passes them: a plain layer's calls stay as they were.
    extra: dict = {}
    if kind != FULL_ATTENTION or sinks is not None:
        extra = {"window": kind.sliding_window, "softcap": kind.logit_softcap, "sinks": sinks}
    prefill_extra = dict(extra)
    if fp8_qk and k_cache.dtype == torch.float8_e4m3fn:
        prefill_extra["fp8_qk"] = True
    if nd == m.num_seqs:
        return ops.paged_decode_attention(
            query, k_cache, v_cache, m.block_tables, m.seq_lens, scale, m.max_seq_len, **extra
        )
    prefill_qsl = m.query_start_loc[nd:] - nd
    block_tables, seq_lens = m.block_tables[nd:], m.seq_lens[nd:]
    if nd:
        # Triton specializes kernels on pointer alignment, and a view starting at an odd row
        # would compile another variant mid-run (seen on an H200: one 1.1 s step in a 21 s
        # benchmark). The engine's table rows are 64 bytes apart, so its rows are always aligned.
        block_tables, seq_lens = aligned(block_tables), aligned(seq_lens)
    # Both kernels write their rows of one output (no concatenation afterwards: a copy of every
    # row per layer, 1.1 ms of a 197 ms mixed step on an H200).
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    ops.paged_prefill_attention(
        query[nd:],
        k_cache,
        v_cache,
        block_tables,
        prefill_qsl,
        seq_lens,
        scale,
        m.max_query_len,
        m.max_seq_len,
        out=out[nd:],
        **prefill_extra,
    )
    if nd:
        ops.paged_decode_attention(
            query[:nd], k_cache, v_cache, m.block_tables[:nd], m.seq_lens[:nd], scale,
            m.max_seq_len, out=out[:nd], **extra,
        )  # fmt: skip
    return out


def aligned(rows: torch.Tensor) -> torch.Tensor:
    """`rows` itself when it starts 16-byte aligned, else an aligned copy with the same strides.

    A copy keeps the row stride (unlike clone(), which packs a cut table's rows at its own
    width): Triton also specializes on whether a stride divides by 16, and a stride that follows
    the step's width would compile yet another variant whenever the width crosses a multiple of
    16 (a 1.8 s stall at 1000/1000 on an H200).
    """
    if rows.data_ptr() % 16 == 0:
        return rows
    copy = torch.empty_strided(rows.shape, rows.stride(), dtype=rows.dtype, device=rows.device)
    return copy.copy_(rows)
