"""Triton attention over the paged KV cache: the GPU fast path (same contract as "torch")."""

from __future__ import annotations

import torch

from kiln.attention.torch_backend import PagedAttentionBackend
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton._device import num_sms
from kiln.kernels.triton.decode_attention import choose_num_splits

# Smallest context bucket of a split-K decode graph: below it splits are few and cheap anyway.
_MIN_GRAPH_SEQ_LEN = 256


class TritonAttentionBackend(PagedAttentionBackend):
    name = "triton"
    ops = triton_ops
    supports_cuda_graphs = True

    def decode_graph_seq_lens(
        self, num_seqs: int, num_kv_heads: int, max_model_len: int, device: torch.device
    ) -> list[int]:
        """The decode kernel cuts contexts into splits from max_seq_len when the batch alone
        leaves SMs idle. A graph captured at max_model_len would freeze partitions sized for the
        longest context (batch 1 at 1k context on one partition: 8 programs on 132 SMs), so small
        batches get power-of-two context buckets, each with its own partitioning."""
        if choose_num_splits(num_seqs, num_kv_heads, max_model_len, num_sms(device)) == 1:
            return [max_model_len]
        buckets = []
        seq_len = _MIN_GRAPH_SEQ_LEN
        while seq_len < max_model_len:
            buckets.append(seq_len)
            seq_len *= 2
        return [*buckets, max_model_len]
