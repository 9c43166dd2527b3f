"""Copy-on-write block copies for every layer's K and V cache in one launch (twin of
reference.copy_kv_blocks).

A beam step forks up to W - 1 partial blocks; done per cache with torch, that is two launches for
each of 2 x num_layers caches (128 for an 8B model), host time a beam step cannot hide: the
next step waits for the selection anyway. Here one program copies one block of one cache, the
caches found through a table of their addresses (built once per set of caches), and the bytes
move as 32-bit words whatever the cache's element type (float8 included).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kiln.kernels.kv_layout import check_head_major

_WORDS_PER_PROGRAM = 1024

# id(caches) -> (caches, [num_caches] int64 addresses, words per block, aligned). The list is
# held, so its id is not reused while the entry lives; checking the caches and reading 64
# data_ptrs on every call cost ~0.1-0.4 ms of a beam step's host time (the runner passes the
# same list each step, never changed in place).
_prepared: dict[int, tuple[list[torch.Tensor], torch.Tensor, int, bool]] = {}


@triton.jit
def _copy_blocks_kernel(
    addresses_ptr,  # [num_caches] int64: each cache's base address
    mapping_ptr,  # [num_copies, 2] int64: (source, destination) block ids
    words_per_block,
    WORD: tl.constexpr,  # tl.int32, or tl.int8 when a block is not a whole number of words
    CHUNK: tl.constexpr,
):
    copy = tl.program_id(0)
    cache = tl.program_id(1)
    chunk = tl.program_id(2)
    base = tl.load(addresses_ptr + cache).to(tl.pointer_type(WORD))
    src = tl.load(mapping_ptr + 2 * copy)
    dst = tl.load(mapping_ptr + 2 * copy + 1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < words_per_block
    words = tl.load(base + src * words_per_block + offs, mask=mask)
    tl.store(base + dst * words_per_block + offs, words, mask=mask)


def copy_kv_blocks(
    caches: list[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_copies, 2] int64 (source, destination), on the device
) -> None:
    """Copy-on-write forks: block `source` of every cache (each layer's K and V) into block
    `destination`. Destinations are distinct and never a source in the same call. `caches` is
    checked once per list: a list must not be changed in place between calls."""
    num_copies = block_mapping.shape[0]
    if num_copies == 0 or not caches:
        return
    entry = _prepared.get(id(caches))
    if entry is None or entry[0] is not caches or entry[1].shape[0] != len(caches):
        if len(_prepared) >= 8:  # (one list per runner: only throwaway lists pile up)
            _prepared.clear()
        entry = _prepared[id(caches)] = (caches, *_prepare(caches))
    _, addresses, words_per_block, aligned = entry
    mapping = block_mapping.to(torch.int64).contiguous()
    grid = (num_copies, len(caches), triton.cdiv(words_per_block, _WORDS_PER_PROGRAM))
    _copy_blocks_kernel[grid](
        addresses, mapping, words_per_block,
        WORD=tl.int32 if aligned else tl.int8, CHUNK=_WORDS_PER_PROGRAM, num_warps=4,
    )  # fmt: skip


def _prepare(caches: list[torch.Tensor]) -> tuple[torch.Tensor, int, bool]:
    """The caches' address table, words per block and whether blocks move as 32-bit words."""
    first = caches[0]
    for cache in caches:
        check_head_major(cache, cache)  # each block's bytes together
        assert cache.shape == first.shape and cache.dtype == first.dtype
    block_bytes = first[0].numel() * first.element_size()
    aligned = block_bytes % 4 == 0 and all(c.data_ptr() % 4 == 0 for c in caches)
    addresses = torch.tensor([c.data_ptr() for c in caches], dtype=torch.int64, device=first.device)
    return addresses, block_bytes // (4 if aligned else 1), aligned
