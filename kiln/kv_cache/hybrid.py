"""The KV manager of a hybrid model (Gemma 2/3): one block table per KV cache group over one
shared block pool (kiln.models.kv_groups says why one pool).

Each group is a KVCacheManager of its own (its window, its requests' block lists, its
prefix-cache entries under its own tag) over the shared pool: a windowed group gives back the
blocks behind its window while the full group keeps the whole history. Every group's list of a
request has one entry per block of its tokens (a block left behind a window stands as a
placeholder), so all groups allocate alike and a request's block ids travel as the groups'
lists one after another, of equal length (NewRequestData.block_ids), which the runner splits.

A prefix hit of n blocks needs the full groups' first n blocks and each windowed group's blocks
inside the window of the token after them (vLLM's hybrid rule); a block reallocated by another
group has lost its hash, so no group takes another's keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from kiln.interfaces import KVCacheRequest
from kiln.kv_cache.block_pool import BlockPool, KVBlock
from kiln.kv_cache.manager import BEHIND_WINDOW, KVCacheManager, PrefixCacheStats


class HybridKVCacheManager:
    """`windows`: each group's window (None: full attention), in the layout's order."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window: int | None = None  # (no window every layer has)
        self.pool = BlockPool(num_blocks, enable_caching)
        self.groups = [
            KVCacheManager(
                num_blocks, block_size, enable_caching, window, self.pool, bytes([g]) * 4
            )
            for g, window in enumerate(windows)
        ]
        self._windowed = [g for g in self.groups if g.sliding_window is not None]
        self.stats = PrefixCacheStats()
        # The computed-token count at which a running request's next block falls behind a
        # window: below it, a step that needs no new block and fills none has nothing to do.
        self._window_mark: dict[str, int] = {}

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVBlock], int]:
        """The longest prefix every group can serve, in whole blocks, leaving at least one
        token to compute; the hits are each group's list in turn (equal lengths)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        groups = self.groups
        groups[0].update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        found = [g.lookup(hashes) for g in groups]
        holds = [g.hits_that_hold(f) for g, f in zip(groups, found)]
        num_hit = next(n for n in range(len(hashes), -1, -1) if all(h[n] for h in holds))
        # Blocks a windowed group no longer has stand as placeholders (allocate_slots takes
        # none of them: they lie behind the window).
        hits = [
            block if block is not None else BEHIND_WINDOW for f in found for block in f[:num_hit]
        ]
        return hits, num_hit * self.block_size

    def record_admission(self, request: KVCacheRequest, num_hit_tokens: int) -> None:
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> list[KVBlock] | None:
        """KVCacheManager.allocate_slots in every group, or in none when the pool cannot hold
        them all. Returns the groups' new blocks in turn (as many in each)."""
        req_id = request.req_id
        if not new_computed_blocks:
            # A decode, most steps: every group's list is as long as the first's, and nothing
            # changes unless a block is opened, filled or left behind a window.
            first = self.groups[0]
            blocks = first.req_to_blocks.get(req_id)
            if blocks is not None:
                total = request.num_computed_tokens + num_new_tokens
                if (
                    -(-total // self.block_size) <= len(blocks)
                    and request.num_computed_tokens < self._window_mark.get(req_id, 0)
                    and (
                        not self.enable_caching
                        or total // self.block_size <= first.num_cached_blocks(req_id)
                    )
                ):
                    return []
        new_blocks = self._allocate(request, num_new_tokens, new_computed_blocks)
        if new_blocks is not None and self._windowed:
            bs = self.block_size
            self._window_mark[req_id] = min(
                (g.num_behind(req_id) + 1) * bs + g.sliding_window - 1
                for g in self._windowed
                if g.sliding_window is not None
            )
        return new_blocks

    def _allocate(
        self, request: KVCacheRequest, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock]
    ) -> list[KVBlock] | None:
        groups = self.groups
        n = len(new_computed_blocks) // len(groups)
        hits = [new_computed_blocks[g * n : (g + 1) * n] for g in range(len(groups))]
        if not new_computed_blocks:
            for group in self._windowed:  # first: what they give back counts as free
                group.free_behind_window(request)
        needed = sum(g.num_blocks_needed(request, num_new_tokens, h) for g, h in zip(groups, hits))
        if needed > self.pool.num_free_blocks:
            return None
        new_blocks: list[KVBlock] = []
        for group, group_hits in zip(groups, hits):
            blocks = group.allocate_slots(request, num_new_tokens, group_hits)
            assert blocks is not None, "counted above"
            new_blocks += blocks
        return new_blocks

    def fork(self, parent: KVCacheRequest, children: Sequence[KVCacheRequest]) -> bool:
        """KVCacheManager.fork in every group, or in none when the pool cannot hold them all."""
        groups = self.groups
        if sum(g.num_fork_blocks(parent, children) for g in groups) > self.pool.num_free_blocks:
            return False
        forked = [g.fork(parent, children) for g in groups]
        assert all(forked) or not any(forked), "the groups hold alike"
        return forked[0]

    def take_block_copies(self) -> list[tuple[int, int]]:
        return [copy for g in self.groups for copy in g.take_block_copies()]

    def block_ids(self, req_id: str) -> list[int]:
        """Every group's block ids of the request, one group after another (equal lengths)."""
        return [i for g in self.groups for i in g.block_ids(req_id)]

    def free_excess_slots(self, request: KVCacheRequest) -> None:
        for group in self.groups:
            group.free_excess_slots(request)

    def free(self, request: KVCacheRequest) -> None:
        self._window_mark.pop(request.req_id, None)
        for group in self.groups:
            group.free(request)
