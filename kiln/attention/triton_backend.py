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
    """Prefill over a float8 cache runs Q @ K^T as a float8 tensor-core dot (heads of 32 dims
    and more; P @ V on widened values): 474 TFLOP/s at a 16k causal prompt on an H100 against
    340 with K widened. A float8 cache already needs float8 tensor cores (compute capability
    8.9, quantization.device.check_float8_device), so every GPU that has one runs them."""

    name = "triton"
    ops = triton_ops
    supports_cuda_graphs = True
    fp8_qk = True

    def decode_graph_seq_lens(
        self, num_seqs: int, num_kv_heads: int, max_model_len: int, device: torch.device
    ) -> list[int]:
        """Small batches get power-of-two context buckets from 256 up, and max_model_len, each
        captured with the split count eager mode chooses at it (choose_num_splits). A graph
        freezes only that count: each sequence's partitions follow its own length on the device.
        So buckets of equal count would capture the same graph, and only the largest of each run
        is kept (batch 1 on an H200: 4, 8, 16, 32 splits up to 2k, then 64 up to max_model_len;
        batches of 16 and more: one graph)."""
        sms = num_sms(device)
        candidates = []
        seq_len = _MIN_GRAPH_SEQ_LEN
        while seq_len < max_model_len:
            candidates.append(seq_len)
            seq_len *= 2
        candidates.append(max_model_len)
        splits = [choose_num_splits(num_seqs, num_kv_heads, c, sms) for c in candidates]
        # choose_num_splits never falls as the context grows: equal counts are contiguous.
        return [
            c
            for i, c in enumerate(candidates)
            if i + 1 == len(candidates) or splits[i + 1] != splits[i]
        ]
