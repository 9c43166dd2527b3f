"""How a decode kernel cuts one sequence's context into split-K partitions, and how it marks the
slots of partitions a sequence does not have (shared by the decode kernels, so their reduce merges
exactly the partitions written)."""

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


@triton.jit
def _mark_unused_split(part_lse_ptr, seq, kv_head, split, num_splits, NUM_KV_HEADS: tl.constexpr,
                       GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):  # fmt: skip
    """A split past its sequence's last partition (a short context in a grid sized for a longer
    one, as a graph replay has) writes a log-sum-exp of -inf into its query heads' slots: weight
    0 in the reduce, which so needs no seq_len to know which slots hold partitions (its stale
    output is never read into the sum)."""
    rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + rows
    slots = (seq.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * num_splits + split
    tl.store(
        part_lse_ptr + slots, tl.full([GROUP_PAD], float("-inf"), tl.float32), mask=rows < GROUP
    )


@triton.jit
def _window_start(seq_len, window, ALIGN: tl.constexpr, SLIDING: tl.constexpr):
    """(first key the query sees, that key's tile start, a multiple of ALIGN): a sliding window's
    last `window` keys, else (0, 0). Partitions cut [tile start, seq_len), so a graph captured
    at one context stays right at any other."""
    if SLIDING:
        lo = tl.maximum(seq_len - window, 0)
        return lo, (lo // ALIGN) * ALIGN
    return 0, 0
