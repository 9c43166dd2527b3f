"""The attention backend interface: what the model needs from attention, and a registry of
implementations ("torch" is the reference on any device; "triton" is the GPU fast path)."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kiln.kernels.ops import resolve_kernel_backend


@dataclass(frozen=True)
class AttentionMetadata:
    """How one step's packed tokens map onto sequences and the paged KV cache.

    Tokens are packed sequence after sequence, with no padding. The first `num_decodes` sequences
    contribute exactly one query token each (decodes); the rest are prefill chunks of any length
    whose earlier tokens (a cached prefix or previous chunks) are already in the cache.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of each token
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: where each sequence's tokens start
    seq_lens: torch.Tensor  # [num_seqs] int32: context length after this step (cached + new)
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    num_decodes: int
    max_query_len: int
    max_seq_len: int
    # A hybrid model's other KV cache groups (kiln.models.kv_groups), groups 1..: the same
    # step through each group's block tables and slot mapping (this is group 0's); the decoder
    # hands each layer its group's. Empty: one group.
    group_metadata: tuple[AttentionMetadata, ...] = ()

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(frozen=True)
class AttentionKind:
    """What one layer's attention computes beyond causal softmax(q k^T * scale) v: data the
    backend's kernels (and, for windows, the KV manager and the memory plan) read."""

    sliding_window: int | None = None
    """Each query sees only the last `sliding_window` positions up to its own; None: all."""
    logit_softcap: float | None = None
    """Scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2)."""


FULL_ATTENTION = AttentionKind()


class AttentionBackend(ABC):
    """Attends over the paged KV cache, which already holds this step's keys and values: the
    model writes them (rotated) in the op that projects them, `ops.add_rms_norm_qkv_rotary_write_kv`
    (one kernel with the projection at batch-1 decode on the GPU).

    KV cache layout, per layer: k_cache and v_cache are each
    [num_blocks, block_size, num_kv_heads, head_dim], head-major beneath (kiln.kernels.kv_layout).
    """

    name: str
    supports_cuda_graphs: bool = False
    """Decode steps may be captured in CUDA graphs (no host syncs, no data-dependent launches)."""

    def decode_graph_seq_lens(
        self, num_seqs: int, num_kv_heads: int, max_model_len: int, device: torch.device
    ) -> list[int]:
        """Context-length buckets to capture decode graphs at for a batch of `num_seqs`.

        A graph freezes every host-side launch choice made from `metadata.max_seq_len` (a split-K
        factor, say): one graph is needed per distinct choice, captured at the bucket's upper
        bound. The last bucket must be `max_model_len`. Default: choices do not depend on it.
        """
        return [max_model_len]

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kind: AttentionKind = FULL_ATTENTION,
        sinks: torch.Tensor | None = None,  # [num_heads] fp32: per-head logits (gpt-oss)
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


# Kernel-backend name -> "module:Class", imported only when chosen (a GPU backend must not be
# imported on the CPU).
_BACKENDS: dict[str, str] = {
    "torch": "kiln.attention.torch_backend:TorchAttentionBackend",
    "triton": "kiln.attention.triton_backend:TritonAttentionBackend",
}


def get_attention_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend of a kernel-backend name ("auto" resolves as kernels.ops does: one choice)."""
    name = resolve_kernel_backend(name, device)
    module_name, class_name = _BACKENDS[name].split(":")
    module = importlib.import_module(module_name)
    return getattr(module, class_name)()
