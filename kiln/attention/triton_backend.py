"""Triton attention over the paged KV cache: the GPU fast path (same contract as "torch")."""

from __future__ import annotations

import torch

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.attention.torch_backend import run_split_attention
from kiln.kernels import triton as triton_ops


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        triton_ops.write_kv_cache(key, value, k_cache, v_cache, metadata.slot_mapping)
        return run_split_attention(triton_ops, query, k_cache, v_cache, metadata, scale)
