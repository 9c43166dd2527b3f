"""Maps requests to KV blocks: prefix-cache lookup, slot allocation, copy-on-write forks,
freeing; for a model whose every layer has a sliding window, the blocks the window has left
behind go back to the pool while the request runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kiln.interfaces import KVCacheRequest
from kiln.kv_cache.block_pool import BlockPool, KVBlock, hash_block_tokens

# Stands in a request's block list for a block the window left behind (given back to the pool,
# never read again: the kernels read no key before a query's window). Never in the pool.
BEHIND_WINDOW = KVBlock(block_id=0)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """`sliding_window`: every layer attends to at most this many latest positions (the model's
    ModelConfig.kv_window), so a request's blocks wholly before its next query's window are
    given back as it runs. They keep their prefix-cache hashes until the pool reallocates them,
    and a prefix hit only ever takes blocks that are still cached (a reallocated block has lost
    its hash), so a hit never reads another request's keys; the blocks of a hit that lie behind
    the window are not taken at all."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        cache_tag: bytes = b"",
    ) -> None:
        """`pool` and `cache_tag`: one KV cache group of a hybrid model (kiln.kv_cache.hybrid)
        shares the pool with the others, and prefixes its cached blocks' hashes with its tag, so
        a group takes back only its own blocks."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self._tag = cache_tag
        # How many leading entries of a request's block list are BEHIND_WINDOW.
        self._num_behind: dict[str, int] = {}
        self.pool = BlockPool(num_blocks, enable_caching) if pool is None else pool
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self.stats = PrefixCacheStats()
        # (source, destination) block ids that fork() copied on the host's books: the next step
        # copies their contents on the device before its forward (SchedulerOutput.block_copies).
        self._pending_block_copies: list[tuple[int, int]] = []

    @property
    def usage(self) -> float:
        return self.pool.usage

    def _update_block_hashes(self, request: KVCacheRequest) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= request.num_tokens:
            start = len(hashes) * bs
            parent = hashes[-1] if hashes else request.hash_root
            hashes.append(hash_block_tokens(parent, request.all_token_ids[start : start + bs]))

    def update_block_hashes(self, request: KVCacheRequest) -> None:
        """Extend the request's chained hashes to its full blocks."""
        self._update_block_hashes(request)

    def num_cached_blocks(self, req_id: str) -> int:
        """How many of the request's first blocks are hashed (registered for prefix reuse)."""
        return self._num_cached_blocks.get(req_id, 0)

    def num_behind(self, req_id: str) -> int:
        """How many of the request's first blocks were given back behind the window."""
        return self._num_behind.get(req_id, 0)

    def get_computed_blocks(self, request: KVCacheRequest) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a waiting request, in whole blocks, leaving at least one
        token to compute (its logits are needed to sample)."""
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            window_hits = self._window_hits(request.block_hashes[:max_blocks])
            return window_hits, len(window_hits) * self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(self._tag + block_hash if self._tag else block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def _window_hits(self, block_hashes: list[bytes]) -> list[KVBlock]:
        """The longest prefix of n blocks whose last ones, those the token after them reads
        through the window, are all cached (a chained hash names its whole prefix, so they
        alone prove it): the blocks before them may be evicted long ago (a conversation's
        early turns). Those stand as BEHIND_WINDOW; allocate_slots takes none of them."""
        found = self.lookup(block_hashes)
        best, run_start = 0, 0
        for n in range(1, len(found) + 1):
            if found[n - 1] is None:
                run_start = n
            elif run_start <= self._first_kept_block(n * self.block_size):
                best = n
        return [b if b is not None else BEHIND_WINDOW for b in found[:best]]

    def lookup(self, block_hashes: list[bytes]) -> list[KVBlock | None]:
        """This group's cached block of each hash (None: not cached)."""
        tag, lookup = self._tag, self.pool.lookup
        return [lookup(tag + h) for h in block_hashes]

    def hits_that_hold(self, found: list[KVBlock | None]) -> list[bool]:
        """For each n in 0..len(found), whether a hit of the first n blocks stands on `found`
        (lookup's answer): every block cached, or with a window those the token after them
        reads."""
        holds, run_start = [True], 0
        for n in range(1, len(found) + 1):
            if found[n - 1] is None:
                run_start = n
            if self.sliding_window is None:
                holds.append(run_start == 0)
            else:  # (its last block cached, as _window_hits asks)
                first_kept = self._first_kept_block(n * self.block_size)
                holds.append(run_start < n and run_start <= first_kept)
        return holds

    def record_admission(self, request: KVCacheRequest, num_hit_tokens: int) -> None:
        """Count a first admission's prefix lookup in the hit-rate statistics."""
        self.stats.queries += request.num_tokens
        self.stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> list[KVBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (prefix hits
        included). Returns the newly allocated blocks, or None when the pool is too small (nothing
        is changed then)."""
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is not None and not new_computed_blocks:
            # A running request's next tokens (a decode, most steps): its block list grows in
            # place, and its full blocks are hashed only when a new one may be publishable; at
            # 512 decodes a step this path is most of the scheduler's time.
            total_tokens = request.num_computed_tokens + num_new_tokens
            if self.sliding_window is not None:
                self._free_behind_window(request.req_id, blocks, request.num_computed_tokens)
            num_new_blocks = -(-total_tokens // self.block_size) - len(blocks)
            new_blocks: list[KVBlock] = []
            if num_new_blocks > 0:
                if num_new_blocks > self.pool.num_free_blocks:
                    return None
                new_blocks = self.pool.allocate(num_new_blocks)
                blocks += new_blocks
            if self.enable_caching and total_tokens // self.block_size > (
                self._num_cached_blocks.get(request.req_id, 0)
            ):
                self._cache_full_blocks(request, blocks, total_tokens)
            return new_blocks
        blocks = blocks or []
        num_behind, taken, num_new_blocks, total_tokens = self._admission(
            request, num_new_tokens, new_computed_blocks
        )
        # Cached hits nobody references sit on the free list: touching them uses up free blocks.
        num_evictable_hits = sum(1 for b in taken if b.ref_count == 0)
        if num_new_blocks + num_evictable_hits > self.pool.num_free_blocks:
            return None
        self.pool.touch(taken)
        new_blocks = self.pool.allocate(num_new_blocks)
        blocks = [*blocks, *[BEHIND_WINDOW] * num_behind, *taken, *new_blocks]
        self.req_to_blocks[request.req_id] = blocks
        if num_behind:
            self._num_behind[request.req_id] = num_behind
        self._cache_full_blocks(request, blocks, total_tokens)
        return new_blocks

    def _admission(
        self, request: KVCacheRequest, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock]
    ) -> tuple[int, list[KVBlock], int, int]:
        """(hits left behind the window, hits taken, new blocks, tokens after the step) of a
        request's admission (or a call with prefix hits)."""
        num_blocks = len(self.req_to_blocks.get(request.req_id) or ())
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        total_tokens = num_computed + num_new_tokens
        num_required = -(-total_tokens // self.block_size)
        num_new_blocks = max(0, num_required - num_blocks - len(new_computed_blocks))
        # Hits wholly behind the first new token's window are not taken (a new request has no
        # blocks yet: its hits start at block 0).
        num_behind = 0
        if self.sliding_window is not None and not num_blocks:
            num_behind = min(self._first_kept_block(num_computed), len(new_computed_blocks))
        return num_behind, list(new_computed_blocks[num_behind:]), num_new_blocks, total_tokens

    def num_blocks_needed(
        self,
        request: KVCacheRequest,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVBlock] = (),
    ) -> int:
        """The free blocks allocate_slots would use up (with a window, after free_behind_window):
        a hybrid model's groups share one pool, so each asks first and none allocates unless
        all fit."""
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is not None and not new_computed_blocks:
            total_tokens = request.num_computed_tokens + num_new_tokens
            return max(0, -(-total_tokens // self.block_size) - len(blocks))
        _, taken, num_new_blocks, _ = self._admission(request, num_new_tokens, new_computed_blocks)
        return num_new_blocks + sum(1 for b in taken if b.ref_count == 0)

    def free_behind_window(self, request: KVCacheRequest) -> None:
        """Give back a running request's blocks behind its next query's window (allocate_slots
        does so too; a hybrid model's groups do it before they count what they need)."""
        blocks = self.req_to_blocks.get(request.req_id)
        if blocks is not None and self.sliding_window is not None:
            self._free_behind_window(request.req_id, blocks, request.num_computed_tokens)

    def _cache_full_blocks(
        self, request: KVCacheRequest, blocks: list[KVBlock], num_tokens: int
    ) -> None:
        # The tokens of this step are known (prompt or already sampled), and their K/V are written
        # before any later step reads them, so their full blocks can be published right away.
        if not self.enable_caching:
            return
        self._update_block_hashes(request)
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        start = self._num_cached_blocks.get(request.req_id, 0)
        # Blocks behind the window were hashed before they were given back (or are hits).
        start = max(start, self._num_behind.get(request.req_id, 0))
        tag = self._tag
        for i in range(start, num_full):
            self.pool.cache_full_block(blocks[i], tag + request.block_hashes[i])
        self._num_cached_blocks[request.req_id] = max(start, num_full)

    def _first_kept_block(self, num_computed: int) -> int:
        """Index of the first block the next query (at position num_computed) may read."""
        assert self.sliding_window is not None
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def _free_behind_window(self, req_id: str, blocks: list[KVBlock], num_computed: int) -> None:
        """Give back the blocks wholly before the window of the query at num_computed (and of
        every later one). A step still in flight (async scheduling) may read them, but a block
        given back now is written again only by a later step, which runs after it."""
        first_kept = self._first_kept_block(num_computed)
        num_behind = self._num_behind.get(req_id, 0)
        if first_kept <= num_behind:
            return
        behind = blocks[num_behind:first_kept]
        blocks[num_behind:first_kept] = [BEHIND_WINDOW] * len(behind)
        self._num_behind[req_id] = first_kept
        self.pool.free(list(reversed(behind)))

    def fork(self, parent: KVCacheRequest, children: Sequence[KVCacheRequest]) -> bool:
        """Copy-on-write: give each child the parent's KV of its first
        `parent.num_computed_tokens` tokens (which the caller guarantees are the children's
        first tokens too). The full blocks are shared by reference; the last, partial block is
        shared with the first child and copied for each other one, since every child writes its
        next token there (the copies are queued for the next step: take_block_copies). Each child
        also gets the blocks its remaining tokens need (a beam's next token past a block
        boundary), so admitting a forked child never waits for the pool. Returns False, changing
        nothing, when the parent holds no such KV or the pool lacks the blocks. The parent keeps
        its references: free it afterwards."""
        blocks = self.req_to_blocks.get(parent.req_id, [])
        bs = self.block_size
        num_tokens = parent.num_computed_tokens
        num_full, num_partial = divmod(num_tokens, bs)
        num_shared = num_full + (num_partial > 0)
        num_own = self._fork_own_blocks(parent, children)
        if not num_tokens or len(blocks) < num_shared or sum(num_own) > self.pool.num_free_blocks:
            return False
        shared = blocks[:num_shared]
        num_hashed = min(self._num_cached_blocks.get(parent.req_id, 0), num_full)
        num_behind = self._num_behind.get(parent.req_id, 0)  # (< num_full: wholly computed)
        for index, child in enumerate(children):
            own = shared if index == 0 else shared[:num_full]
            self.pool.touch(own[num_behind:])
            if num_behind:
                self._num_behind[child.req_id] = num_behind
            new = self.pool.allocate(num_own[index])
            if index and num_partial:  # the partial block's tokens go first into its own copy
                self._pending_block_copies.append((shared[-1].block_id, new[0].block_id))
            self.req_to_blocks[child.req_id] = [*own, *new]
            # The shared full blocks hold the same tokens: the same chained hashes.
            child.block_hashes[:] = parent.block_hashes[:num_full]
            self._num_cached_blocks[child.req_id] = num_hashed
        return True

    def _fork_own_blocks(
        self, parent: KVCacheRequest, children: Sequence[KVCacheRequest]
    ) -> list[int]:
        """The new blocks fork() gives each child: those its tokens need past the parent's
        shared ones (the first child shares the partial block)."""
        num_full, num_partial = divmod(parent.num_computed_tokens, self.block_size)
        return [
            -(-child.num_tokens // self.block_size) - num_full - (num_partial > 0 and i == 0)
            for i, child in enumerate(children)
        ]

    def num_fork_blocks(self, parent: KVCacheRequest, children: Sequence[KVCacheRequest]) -> int:
        """The free blocks fork() would use up."""
        return sum(self._fork_own_blocks(parent, children))

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The block copies fork() queued since the last call, for the next step to run."""
        copies, self._pending_block_copies = self._pending_block_copies, []
        return copies

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def free_excess_slots(self, request: KVCacheRequest) -> None:
        """Give back the blocks past the request's computed tokens (speculative decoding: slots
        of rejected drafts). They hold no full block of known tokens, so none is cached."""
        blocks = self.req_to_blocks.get(request.req_id)
        if not blocks:
            return
        keep = -(-request.num_computed_tokens // self.block_size)
        if len(blocks) > keep:
            excess = blocks[keep:]
            del blocks[keep:]
            self.pool.free(list(reversed(excess)))

    def free(self, request: KVCacheRequest) -> None:
        blocks = self.req_to_blocks.pop(request.req_id, [])
        self._num_cached_blocks.pop(request.req_id, None)
        blocks = blocks[self._num_behind.pop(request.req_id, 0) :]
        if self._pending_block_copies and blocks:
            # A forked request let go before its copy ran (an abort): the copy would write into
            # a block someone else may get now.
            freed = {b.block_id for b in blocks if b.ref_count == 1}
            self._pending_block_copies = [
                c for c in self._pending_block_copies if c[1] not in freed
            ]
        self.pool.free(list(reversed(blocks)))
