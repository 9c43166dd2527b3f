"""The KV manager of a hybrid model (a full-attention group and windowed groups over one pool):
the windowed groups give back the blocks behind their window while the full group keeps the
whole history; allocation is all groups or none; a prefix hit needs the full group's every
block and the windowed groups' window; forks and frees cover every group. No torch."""

from __future__ import annotations

from kiln.engine.request import Request
from kiln.kv_cache.hybrid import HybridKVCacheManager
from kiln.kv_cache.manager import BEHIND_WINDOW
from kiln.sampling_params import SamplingParams

BS = 4
WINDOW = 6
WINDOWS = (None, WINDOW, WINDOW)  # Gemma 3's shape: a full group, two windowed ones


def _request(req_id: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=max_tokens), (2,), 8)


def _held(kv: HybridKVCacheManager, req_id: str) -> list[int]:
    """Blocks the request holds in each group (not counting those behind a window)."""
    return [sum(b is not BEHIND_WINDOW for b in g.req_to_blocks[req_id]) for g in kv.groups]


def _step(kv: HybridKVCacheManager, request: Request, num_new: int) -> list[int]:
    new = kv.allocate_slots(request, num_new)
    assert new is not None
    request.num_computed_tokens += num_new
    return [b.block_id for b in new]


def test_windowed_groups_stay_bounded_while_the_full_group_grows() -> None:
    kv = HybridKVCacheManager(64, BS, windows=WINDOWS)
    request = _request("a", list(range(100, 120)), max_tokens=100)  # 5 blocks of prompt
    _step(kv, request, 20)
    full: list[int] = []
    windowed: list[list[int]] = []
    for token in range(100):  # a long generation: 120 tokens, 30 blocks
        request.append_output_token(7 + token % 50)
        _step(kv, request, 1)
        held = _held(kv, "a")
        full.append(held[0])
        windowed.append(held[1:])
    assert full[-1] == 30 and full == sorted(full)  # the whole history
    # A window of 6 reads at most 2 blocks, plus the one the next token opens.
    assert max(max(w) for w in windowed) <= 3
    assert kv.pool.num_free_blocks == 64 - full[-1] - sum(windowed[-1])
    # Each group's block list keeps one entry per block of tokens (the runner splits them).
    ids = kv.block_ids("a")
    assert len(ids) == 3 * 30
    kv.free(request)
    assert kv.pool.num_free_blocks == 64


def test_new_blocks_come_in_equal_parts_per_group() -> None:
    kv = HybridKVCacheManager(64, BS, windows=WINDOWS)
    request = _request("a", list(range(100, 118)))  # 18 tokens
    first = _step(kv, request, 10)  # 3 blocks in each group
    assert len(first) == 9 and len(set(first)) == 9  # no block in two groups
    assert _step(kv, request, 8) and len(kv.block_ids("a")) == 3 * 5


def test_allocation_takes_every_group_or_none() -> None:
    kv = HybridKVCacheManager(8, BS, windows=WINDOWS)
    request = _request("a", list(range(100, 112)))  # 3 blocks in each group: 9 > 8
    assert kv.allocate_slots(request, 12) is None
    assert kv.pool.num_free_blocks == 8
    assert all("a" not in g.req_to_blocks for g in kv.groups)
    assert kv.allocate_slots(request, 8) is not None  # 2 blocks a group: 6
    assert kv.pool.num_free_blocks == 2


def test_prefix_hit_needs_the_full_history_and_the_window() -> None:
    kv = HybridKVCacheManager(64, BS, windows=WINDOWS)
    prompt = list(range(100, 140))  # 10 blocks
    first = _request("a", prompt)
    for _ in range(5):
        _step(kv, first, 8)
    kv.free(first)
    again = _request("b", [*prompt, 7])
    hits, num_hit_tokens = kv.get_computed_blocks(again)
    assert num_hit_tokens == 40 and len(hits) == 3 * 10
    full_hits, *windowed_hits = (hits[g * 10 : (g + 1) * 10] for g in range(3))
    assert BEHIND_WINDOW not in full_hits
    for group_hits in windowed_hits:
        # Given back as the window passed, then cached: still there, but only the blocks the
        # token after the prompt reads are needed (and taken).
        assert all(b is not BEHIND_WINDOW for b in group_hits[8:])
    free_before = kv.pool.num_free_blocks
    assert kv.allocate_slots(again, 1, hits) is not None
    # Taken: the full group's 10 hits and each windowed group's last 2, plus a block each.
    assert free_before - kv.pool.num_free_blocks == 10 + 2 * 2 + 3
    assert _held(kv, "b") == [11, 3, 3]
    kv.free(again)


def test_prefix_hit_stops_where_the_full_group_lost_a_block() -> None:
    kv = HybridKVCacheManager(64, BS, windows=WINDOWS)
    prompt = list(range(100, 140))
    first = _request("a", prompt)
    _step(kv, first, 40)
    kv.free(first)
    # Block 4 of the full group is reallocated (its hash goes with it).
    full = kv.groups[0]
    block = full.lookup([first.block_hashes[4]])[0]
    assert block is not None
    kv.pool._free.move_to_end(block.block_id, last=False)
    kv.pool.allocate(1)
    _, num_hit_tokens = kv.get_computed_blocks(_request("b", [*prompt, 7]))
    assert num_hit_tokens == 4 * BS  # the windowed groups' later blocks do not help


def test_prefix_hit_stops_where_a_window_lost_its_blocks() -> None:
    kv = HybridKVCacheManager(64, BS, windows=WINDOWS)
    prompt = list(range(100, 140))
    first = _request("a", prompt)
    _step(kv, first, 40)
    kv.free(first)
    windowed = kv.groups[2]
    for i in (8, 9):  # the window's blocks at the prompt's end, in one windowed group
        block = windowed.lookup([first.block_hashes[i]])[0]
        assert block is not None
        kv.pool._free.move_to_end(block.block_id, last=False)
    kv.pool.allocate(2)
    hits, num_hit_tokens = kv.get_computed_blocks(_request("b", [*prompt, 7]))
    # 8 blocks: the token after them reads blocks 6 and 7 through a window of 6, still cached.
    assert num_hit_tokens == 8 * BS
    assert len(hits) == 3 * 8


def test_fork_shares_every_group_and_frees_cleanly() -> None:
    kv = HybridKVCacheManager(64, BS, windows=WINDOWS)
    parent = _request("p", list(range(100, 110)))  # 10 tokens: 2 full blocks and a partial
    _step(kv, parent, 10)
    kids = [_request(f"k{i}", [*range(100, 110), 50 + i]) for i in range(2)]
    assert kv.fork(parent, kids)
    kv.free(parent)
    for kid in kids:
        assert len(kv.block_ids(kid.req_id)) == 3 * 3
    # The second child copies the partial block in each group.
    assert len(kv.take_block_copies()) == 3
    for kid in kids:
        kv.free(kid)
    assert kv.pool.num_free_blocks == 64


def test_fork_needs_room_in_every_group() -> None:
    kv = HybridKVCacheManager(10, BS, windows=WINDOWS)
    parent = _request("p", list(range(100, 110)))
    _step(kv, parent, 10)  # 9 blocks
    kids = [_request(f"k{i}", [*range(100, 110), 50 + i]) for i in range(2)]
    assert not kv.fork(parent, kids)  # a copy per group: 3 blocks, 1 free
    assert kv.pool.num_free_blocks == 1
