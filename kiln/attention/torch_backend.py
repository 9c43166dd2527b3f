"""Pure-PyTorch attention over the paged KV cache: the reference backend, used on the CPU."""

from __future__ import annotations

from types import ModuleType

import torch

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.kernels import reference


class PagedAttentionBackend(AttentionBackend):
    """Attends with `ops`' decode and prefill kernels. Backends differ only in their `ops` module
    (the kernel twins share one signature)."""

    ops: ModuleType

    def forward(
        self,
        query: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        return run_split_attention(self.ops, query, k_cache, v_cache, metadata, scale)


class TorchAttentionBackend(PagedAttentionBackend):
    name = "torch"
    ops = reference


def run_split_attention(
    ops,  # a module exposing paged_decode_attention and paged_prefill_attention
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    decode_stream: torch.cuda.Stream | None = None,
) -> torch.Tensor:
    """Decodes (the first `num_decodes` sequences, one token each) go through the decode kernel,
    the remaining prefill chunks through the prefill kernel; shared by every backend.

    With `decode_stream` (CUDA), a mixed step's decode kernel runs on that stream while the
    prefill kernel runs on the current one, which waits for it before returning: the decode
    kernel streams the KV cache and the prefill kernel is bound by the tensor cores, so the GPU
    can run them side by side."""
    m = metadata
    nd = m.num_decodes
    if nd == m.num_seqs:
        return ops.paged_decode_attention(
            query, k_cache, v_cache, m.block_tables, m.seq_lens, scale, m.max_seq_len
        )
    prefill_qsl = m.query_start_loc[nd:] - nd
    block_tables, seq_lens = m.block_tables[nd:], m.seq_lens[nd:]
    if nd:
        # Fresh (16-byte aligned) copies: Triton specializes kernels on pointer alignment, and a
        # view starting at an odd row would compile another variant mid-run (seen on an H200:
        # one 1.1 s step in a 21 s benchmark).
        block_tables, seq_lens = block_tables.clone(), seq_lens.clone()
    # Both kernels write their rows of one output (no concatenation afterwards: a copy of every
    # row per layer, 1.1 ms of a 197 ms mixed step on the H200, session5/mixed2).
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)

    def decode() -> None:
        ops.paged_decode_attention(
            query[:nd], k_cache, v_cache, m.block_tables[:nd], m.seq_lens[:nd], scale,
            m.max_seq_len, out=out[:nd],
        )  # fmt: skip

    overlap = nd > 0 and decode_stream is not None
    if overlap:
        # Every tensor the decode kernel touches was made on the current stream, which waits for
        # the decode stream below before any later work (or a reuse of their memory) is queued.
        main_stream = torch.cuda.current_stream(query.device)
        decode_stream.wait_stream(main_stream)
        with torch.cuda.stream(decode_stream):
            decode()
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
    )
    if overlap:
        main_stream.wait_stream(decode_stream)
    elif nd:
        decode()
    return out
