"""The KV block pool: reference counts, an LRU free list and the prefix-cache hash map.

Pure Python: the pool hands out block ids; the tensors they index live in the model runner.
A freed block keeps its hash and its contents until it is reallocated, so a later request with the
same prefix can take it back (a prefix-cache hit) as long as it has not been evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set once the block is full and registered in the cache


def hash_block_tokens(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
    """Chained hash: a block's identity is its tokens *and* everything before them."""
    digest = hashlib.sha256(parent_hash or b"kiln-root")
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks in eviction order: the front is evicted (reallocated) first.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now, counting cached blocks nobody references."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by requests (cached blocks nobody references are free)."""
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by running requests (0.0 when idle)."""
        return 1.0 - len(self._free) / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take `num_blocks` free blocks (the caller has checked there are enough)."""
        if num_blocks > len(self._free):
            raise RuntimeError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        taken = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:  # evict its old contents from the prefix cache
                if self._cached.get(block.block_hash) is block:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit), pulling them off the free list."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; unreferenced ones join the tail of the free list.

        Callers pass a request's blocks in reverse order, so that the end of a sequence (the least
        shareable part) is evicted before its prefix.
        """
        for block in blocks:
            block.ref_count -= 1
            if block.ref_count < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than taken")
            if block.ref_count == 0:
                self._free[block.block_id] = block

    def cache_full_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its chained hash so later requests can reuse it."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:  # same contents already cached in another block
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True
