"""The KV manager on a model whose every layer has a sliding window: blocks behind a running
request's window go back to the pool, and a prefix hit never takes a block that was given back
and reallocated (it would hold another request's keys). No torch."""

from __future__ import annotations

from kiln.engine.request import Request
from kiln.kv_cache.manager import KVCacheManager
from kiln.sampling_params import SamplingParams

BS = 4
WINDOW = 6


def _request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), (2,), 8)


def _run(kv: KVCacheManager, request: Request, chunk: int) -> list[int]:
    """Computes the request's prompt in chunks; returns the blocks it held after each step."""
    held = []
    while request.num_computed_tokens < request.num_tokens:
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, num_new) is not None
        request.num_computed_tokens += num_new
        held.append(kv.pool.num_blocks - kv.pool.num_free_blocks)
    return held


def _visible_blocks(kv: KVCacheManager, request: Request) -> list[int]:
    """Indices of the blocks the next query (at num_computed_tokens) may read."""
    first = max(0, request.num_computed_tokens - WINDOW + 1) // BS
    return list(range(first, -(-request.num_computed_tokens // BS)))


def test_blocks_behind_the_window_are_given_back() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, sliding_window=WINDOW)
    request = _request("a", list(range(100, 160)))  # 60 tokens: 15 blocks, the pool holds 8
    held = _run(kv, request, chunk=3)
    # A window of 6 and chunks of 3: at most 3 blocks ever held (the window's two and the next).
    assert max(held) <= 3
    blocks = kv.req_to_blocks["a"]
    assert len(blocks) == 15  # positions kept: block i still holds tokens [4i, 4i + 4)
    for i in _visible_blocks(kv, request):
        assert blocks[i].ref_count == 1  # what the kernels read is still this request's
    kv.free(request)
    assert kv.pool.num_free_blocks == 8


def test_prefix_hit_never_takes_a_reallocated_block() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=WINDOW)
    prompt = list(range(100, 140))  # 10 blocks
    first = _request("a", prompt)
    _run(kv, first, chunk=8)  # its early blocks are given back and taken again on the way
    kv.free(first)
    # Another request reallocates some of the blocks `first` gave back (their hashes are gone).
    other = _request("b", list(range(500, 524)))
    _run(kv, other, chunk=24)
    again = _request("c", [*prompt, 7, 8, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    first_read = max(0, num_hit_tokens - WINDOW + 1) // BS
    assert num_hit_tokens > 0  # the prompt's last blocks are still cached
    for i, block in enumerate(hits[first_read:], first_read):
        # A hit the next token reads is the very block that holds these tokens: still hashed
        # as their chain (never one given back and reallocated).
        assert block.block_hash == again.block_hashes[i]
        assert block not in kv.req_to_blocks["b"]
    assert kv.allocate_slots(again, 8, hits) is not None
    again.num_computed_tokens = num_hit_tokens + 8
    for i in range(first_read):
        assert kv.req_to_blocks["c"][i].ref_count == 0  # behind the window: nothing taken
    _run(kv, again, chunk=8)
    kv.free(again)
    kv.free(other)
    assert kv.pool.num_free_blocks == 12


def test_full_hit_behind_the_window_takes_only_the_window() -> None:
    kv = KVCacheManager(num_blocks=32, block_size=BS, sliding_window=WINDOW)
    prompt = list(range(100, 140))
    first = _request("a", prompt)
    _run(kv, first, chunk=40)  # one step: every block written and hashed before any is freed
    kv.free(first)
    again = _request("b", [*prompt, 1])
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 40
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(again, 1, hits) is not None
    # The window of the token at 40 reads 35..40: blocks 8 and 9 of the hits, and one new block.
    assert free_before - kv.pool.num_free_blocks == 3
    kv.free(again)
    assert kv.pool.num_free_blocks == 32


def test_fork_shares_only_the_window() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, sliding_window=WINDOW)
    parent = _request("p", list(range(100, 130)))  # 30 tokens
    _run(kv, parent, chunk=4)
    children = [_request(f"c{i}", [*range(100, 130), 50 + i]) for i in range(3)]
    for child in children:
        child.num_computed_tokens = parent.num_computed_tokens
    assert kv.fork(parent, children)
    kv.free(parent)
    for child in children:
        assert kv.allocate_slots(child, 1) is not None
        child.num_computed_tokens += 1
    for child in children:
        kv.free(child)
    assert kv.pool.num_free_blocks == 16  # every reference given back exactly once


def test_no_window_keeps_every_block() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    request = _request("a", list(range(100, 160)))
    assert _run(kv, request, chunk=4)[-1] == 15


def test_conversation_hits_its_window_after_its_start_is_evicted() -> None:
    # A conversation's next turn: its first blocks went back to the pool as the window moved
    # and were reallocated, yet the blocks its next token reads are cached: a hit of the prefix.
    kv = KVCacheManager(num_blocks=6, block_size=BS, sliding_window=WINDOW)
    turn = _request("a", list(range(100, 140)))  # 10 blocks through a pool of 6
    _run(kv, turn, chunk=4)
    kv.free(turn)
    assert kv.pool.lookup(turn.block_hashes[0]) is None  # its start is gone
    following = _request("b", [*range(100, 140), 5, 6, 7])
    hits, num_hit_tokens = kv.get_computed_blocks(following)
    assert num_hit_tokens == 40
    assert kv.allocate_slots(following, 3, hits) is not None
    following.num_computed_tokens = 43
    kv.free(following)
    assert kv.pool.num_free_blocks == 6
