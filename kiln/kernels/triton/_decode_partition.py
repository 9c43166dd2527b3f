"""How a decode kernel cuts one sequence's context into split-K partitions (shared by the decode
kernels and their reduce, so the reduce merges exactly the partitions written)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _partition(seq_len, num_splits, BLOCK_N: tl.constexpr):
    """(tokens per partition, partitions in use) of one sequence: its context cut into at most
    num_splits partitions of whole BLOCK_N tiles (at least one tile, so a zero length divides by
    no zero). Both kernels call it, so the reduce merges exactly the partitions written."""
    tiles = tl.maximum(tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N), 1)
    partition_size = tiles * BLOCK_N
    return partition_size, tl.cdiv(seq_len, partition_size)
