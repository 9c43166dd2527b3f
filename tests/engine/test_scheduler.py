"""Scheduler and KV block pool with fake model outputs: no model, no torch."""

from __future__ import annotations

import sys

import pytest

from kiln.engine.request import Request, RequestStatus
from kiln.engine.scheduler import Scheduler
from kiln.interfaces import ModelRunnerOutput, SchedulerOutput
from kiln.kv_cache.block_pool import BlockPool
from kiln.kv_cache.manager import KVCacheManager
from kiln.sampling_params import SamplingParams

EOS = 2


def make_scheduler(
    num_blocks=64,
    block_size=4,
    max_num_seqs=8,
    budget=32,
    policy="fcfs",
    caching=True,
    max_model_len=1024,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_caching=caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, policy)


def make_request(
    req_id, prompt_len=8, max_tokens=4, priority=0, arrival=0.0, prompt=None, **params
) -> Request:
    # Distinct prompts per request id, so no test hits the prefix cache by accident.
    base = 1000 * (1 + sum(ord(c) * 31**k for k, c in enumerate(req_id)) % 997)
    prompt = prompt if prompt is not None else [base + i for i in range(prompt_len)]
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(req_id, prompt, sp, (EOS,), max_tokens, priority=priority, arrival_time=arrival)


def fake_step(s: Scheduler, next_token=lambda req: 7) -> tuple[SchedulerOutput, list]:
    """Schedule, pretend the model ran, sample `next_token` for requests that reached the end."""
    out = s.schedule()
    return out, s.update(out, fake_runner_output(s, out, next_token))


def fake_runner_output(s: Scheduler, out: SchedulerOutput, next_token) -> ModelRunnerOutput:
    """What a runner would return: a token for each scheduled request whose computed tokens
    (advanced by schedule()) reach its end, its last placeholder. Call it right after schedule()."""
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        req = s.requests.get(req_id)
        if req is None or not req.num_output_placeholders:
            continue
        if req.num_computed_tokens == req.num_tokens_with_placeholders - 1:
            sampled[req_id] = [next_token(req)]
    return ModelRunnerOutput(sampled)


def run_to_completion(s: Scheduler, max_steps=1000, **kw) -> list[SchedulerOutput]:
    steps = []
    while s.has_unfinished_requests() and len(steps) < max_steps:
        steps.append(fake_step(s, **kw)[0])
    assert not s.has_unfinished_requests()
    return steps


# ---- block pool ------------------------------------------------------------------------------


def test_block_pool_refcounts_and_lru_eviction():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.num_free_blocks == 2 and a.ref_count == 1
    pool.cache_full_block(a, b"ha")
    pool.free([b, a])  # freed tail first: b is evicted before a
    assert pool.num_free_blocks == 4
    assert pool.lookup(b"ha") is a
    taken = pool.allocate(3)  # the two never-used blocks, then b (freed first)
    assert b in taken and a not in taken
    assert pool.lookup(b"ha") is a  # still cached
    (again,) = pool.allocate(1)
    assert again is a and pool.lookup(b"ha") is None  # evicted: its hash is gone
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_block_pool_touch_takes_cached_blocks_off_free_list():
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_full_block(a, b"h")
    pool.free([a])
    pool.touch([a])
    assert a.ref_count == 1 and pool.num_free_blocks == 1
    pool.touch([a])
    assert a.ref_count == 2
    pool.free([a])
    pool.free([a])
    assert pool.num_free_blocks == 2
    with pytest.raises(RuntimeError):
        pool.free([a])
    assert pool.reset_prefix_cache() and pool.lookup(b"h") is None


def test_prefix_lookup_leaves_one_token_and_chains_hashes():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first = make_request("a", prompt=list(range(12)))
    assert kv.allocate_slots(first, 12) is not None  # 3 full blocks, all published
    same = make_request("b", prompt=list(range(12)))
    hits, num_tokens = kv.get_computed_blocks(same)
    assert num_tokens == 8 and len(hits) == 2  # the last block is recomputed for its logits
    longer = make_request("c", prompt=[*range(12), 50, 51])
    assert kv.get_computed_blocks(longer)[1] == 12
    # Same second block but a different first block: the chain breaks at block 0.
    other = make_request("d", prompt=[99, 1, 2, 3, *range(4, 12)])
    assert kv.get_computed_blocks(other) == ([], 0)


def test_allocate_slots_fails_without_changing_anything():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    r = make_request("a", prompt_len=12)
    assert kv.allocate_slots(r, 12) is None
    assert kv.pool.num_free_blocks == 2 and "a" not in kv.req_to_blocks


# ---- scheduler -------------------------------------------------------------------------------


def test_token_budget_chunks_prefill_and_mixes_decodes():
    s = make_scheduler(budget=16, block_size=4)
    s.add_request(make_request("a", prompt_len=10, arrival=0))
    s.add_request(make_request("b", prompt_len=10, arrival=1))
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}  # b's prompt is chunked
    out, _ = fake_step(s)
    # a decodes one token, b finishes its prefill: decode and prefill share the step.
    assert out.num_scheduled_tokens == {"a": 1, "b": 4}
    assert [c.req_id for c in out.cached_requests] == ["a", "b"]
    assert s.requests["b"].num_output_tokens == 1
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}


def test_decodes_go_before_a_long_prefill_of_higher_priority():
    # A long prompt ahead of a decoding request in priority order takes what the decodes leave,
    # not the whole budget: every running decode is scheduled every step.
    s = make_scheduler(budget=16, policy="priority", num_blocks=128, max_model_len=4096)
    s.add_request(make_request("d", prompt_len=4, max_tokens=50, priority=5))
    fake_step(s)
    s.add_request(make_request("long", prompt_len=100, max_tokens=2, priority=0, arrival=1))
    for _ in range(6):
        out, _ = fake_step(s)
        assert out.num_scheduled_tokens["d"] == 1
        assert out.num_scheduled_tokens.get("long", 0) == 15
    assert [r.req_id for r in s.running] == ["long", "d"]  # priority order unchanged


def test_preemption_spares_decodes_scheduled_before_a_prefill():
    # Decodes are scheduled first; a prefill chunk that then needs blocks preempts the
    # lowest-priority request not yet scheduled, never a decode already in the step.
    s = make_scheduler(budget=64, num_blocks=10, block_size=4, caching=False, policy="priority")
    s.add_request(make_request("d", prompt_len=4, max_tokens=30, priority=5))
    fake_step(s)
    s.add_request(make_request("p", prompt_len=24, max_tokens=2, priority=0, arrival=1))
    for _ in range(12):
        out, _ = fake_step(s)
        if "d" in out.num_scheduled_tokens:
            assert s.requests["d"].status == RequestStatus.RUNNING
        if not s.has_unfinished_requests():
            break


def test_max_num_seqs_limits_running():
    s = make_scheduler(max_num_seqs=2)
    for i in range(4):
        s.add_request(make_request(str(i), prompt_len=4, arrival=i))
    out, _ = fake_step(s)
    assert set(out.num_scheduled_tokens) == {"0", "1"}
    steps = run_to_completion(s)
    assert all(len(o.num_scheduled_tokens) <= 2 for o in steps)


def test_stop_rules():
    s = make_scheduler()
    s.add_request(make_request("eos", max_tokens=10, arrival=0))
    s.add_request(make_request("ignore", max_tokens=3, ignore_eos=True, arrival=1))
    s.add_request(make_request("stopid", max_tokens=10, stop_token_ids=[9], arrival=2))
    s.add_request(make_request("min", max_tokens=10, min_tokens=2, arrival=3))
    tokens = {"eos": EOS, "ignore": EOS, "stopid": 9, "min": EOS}
    finished = {}
    while s.has_unfinished_requests():
        _, outs = fake_step(s, next_token=lambda r: tokens[r.req_id])
        for o in outs:
            if o.finish_reason:
                finished[o.req_id] = (o.finish_reason, o.stop_reason)
    assert finished == {
        "eos": ("stop", None),
        "ignore": ("length", None),
        "stopid": ("stop", 9),
        "min": ("stop", None),
    }


def test_max_tokens_and_context_limit():
    s = make_scheduler(max_model_len=10)
    s.add_request(make_request("a", prompt_len=8, max_tokens=100))
    outs = []
    while s.has_unfinished_requests():
        outs += fake_step(s)[1]
    assert sum(len(o.new_token_ids) for o in outs) == 2 and outs[-1].finish_reason == "length"


def test_preemption_by_recompute_keeps_tokens_and_order():
    # 6 blocks of 4 tokens: two requests of 8-token prompts fit (4 blocks) but not as they grow.
    s = make_scheduler(num_blocks=6, block_size=4, caching=False)
    s.add_request(make_request("old", prompt_len=8, max_tokens=8, arrival=0))
    s.add_request(make_request("new", prompt_len=8, max_tokens=8, arrival=1))
    preempted_seen = False
    counter = {"old": 0, "new": 0}

    def token(req):
        counter[req.req_id] += 1
        return 1000 + counter[req.req_id]

    while s.has_unfinished_requests():
        out, _ = fake_step(s, next_token=token)
        if out.num_preempted:
            preempted_seen = True
            assert "new" in out.finished_req_ids  # runner is told to drop its state
            assert s.requests["new"].status == RequestStatus.PREEMPTED
            assert s.requests["new"].num_computed_tokens == 0
        assert s.kv_cache.pool.num_free_blocks >= 0
    assert preempted_seen
    assert s.num_preemptions_total >= 1
    assert s.kv_cache.pool.num_free_blocks == 6


def test_preempted_request_is_resent_in_full():
    s = make_scheduler(num_blocks=5, block_size=4, caching=False)
    s.add_request(make_request("a", prompt_len=8, max_tokens=8, arrival=0))
    s.add_request(make_request("b", prompt_len=7, max_tokens=8, arrival=1))
    resent = None
    while s.has_unfinished_requests():
        out, _ = fake_step(s)
        for new in out.new_requests:
            if new.output_token_ids:
                resent = new
    assert resent is not None
    assert resent.num_computed_tokens == 0 and len(resent.output_token_ids) >= 1


def test_priority_policy_admits_and_preempts_by_priority():
    s = make_scheduler(policy="priority", max_num_seqs=1)
    s.add_request(make_request("low", priority=5, arrival=0))
    s.add_request(make_request("high", priority=-1, arrival=1))
    out, _ = fake_step(s)
    assert list(out.num_scheduled_tokens) == ["high"]

    s = make_scheduler(policy="priority", num_blocks=5, block_size=4, caching=False)
    s.add_request(make_request("low", prompt_len=8, max_tokens=8, priority=5, arrival=0))
    s.add_request(make_request("high", prompt_len=8, max_tokens=8, priority=0, arrival=1))
    victims = set()
    while s.has_unfinished_requests():
        out, _ = fake_step(s)
        victims |= {r for r in out.finished_req_ids if r in s.requests}
    assert victims == {"low"}


def test_abort_frees_blocks_at_once():
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=20, max_tokens=50))
    s.add_request(make_request("b", prompt_len=20, max_tokens=50, arrival=1))
    fake_step(s)
    assert s.kv_cache.usage > 0
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache.usage == 0 and not s.has_unfinished_requests()
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_prefix_cache_hit_on_admission():
    s = make_scheduler(block_size=4)
    prompt = list(range(200, 213))  # 13 tokens: 3 full blocks
    s.add_request(make_request("a", prompt=prompt, max_tokens=2))
    run_to_completion(s)
    s.add_request(make_request("b", prompt=prompt, max_tokens=2))
    out, _ = fake_step(s)
    assert out.new_requests[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens == {"b": 1}
    assert s.kv_cache.stats.hits == 12


def test_scheduler_does_not_import_torch():
    assert "kiln.engine.scheduler" in sys.modules
    import subprocess

    code = (
        "import sys, kiln.engine.scheduler, kiln.kv_cache.manager;sys.exit('torch' in sys.modules)"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---- async scheduling: step N+1 scheduled before step N's tokens are applied ---------------------


def _token_at(req: Request) -> int:
    """A deterministic 'model': the token depends on the request and the output index it fills
    (its outputs so far plus those in flight), so both scheduling orders must agree."""
    index = req.num_output_tokens + req.num_output_placeholders - 1
    if req.req_id == "stops" and index == 3:
        return EOS
    return 100 + 7 * index + len(req.req_id)


def _drive(s: Scheduler, lag: int, finish_after: dict[str, int] | None = None) -> dict:
    """Run to completion with `lag` steps in flight (0: synchronous). Returns each request's
    tokens and finish reason; `finish_after` stops a request (like a stop string) once it has
    that many tokens, from outside the scheduler."""
    from collections import deque

    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    in_flight: deque = deque()
    for _ in range(2000):
        if not (s.has_unfinished_requests() or in_flight):
            break
        out = s.schedule()
        if not out.is_empty:
            in_flight.append((out, fake_runner_output(s, out, _token_at)))
        if len(in_flight) <= lag and s.has_unfinished_requests() and not out.is_empty:
            continue
        if not in_flight:
            continue
        for core in s.update(*in_flight.popleft()):
            tokens.setdefault(core.req_id, []).extend(core.new_token_ids)
            if core.finish_reason:
                reasons[core.req_id] = core.finish_reason
            limit = (finish_after or {}).get(core.req_id)
            if limit is not None and len(tokens[core.req_id]) == limit and not core.finish_reason:
                s.finish_requests([core.req_id], RequestStatus.FINISHED_STOPPED)
                reasons[core.req_id] = "stop"
    assert not s.has_unfinished_requests() and not in_flight
    assert s.kv_cache.pool.num_free_blocks == s.kv_cache.pool.num_blocks
    assert not s._scheduled  # every scheduled step was applied
    return {"tokens": tokens, "reasons": reasons}


def _add_mix(s: Scheduler) -> None:
    s.add_request(make_request("long", prompt_len=13, max_tokens=9, arrival=0))
    s.add_request(make_request("stops", prompt_len=5, max_tokens=12, arrival=1))
    s.add_request(make_request("cut", prompt_len=7, max_tokens=12, arrival=2))
    s.add_request(make_request("one", prompt_len=9, max_tokens=1, arrival=3))
    s.add_request(make_request("late", prompt_len=21, max_tokens=6, arrival=4))


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"budget": 6},  # chunked prefills share steps with decodes
        {"num_blocks": 9, "caching": False},  # preemption, also of requests with tokens in flight
        {"max_num_seqs": 2},
    ],
    ids=["plain", "chunked", "preempting", "two_seqs"],
)
def test_async_order_gives_the_same_tokens(kwargs):
    results = []
    for lag in (0, 1):
        s = make_scheduler(**kwargs)
        _add_mix(s)
        results.append(_drive(s, lag, finish_after={"cut": 4}))
    if "num_blocks" in kwargs:
        assert s.num_preemptions_total > 0  # async: a victim had its token in flight
    sync, async_ = results
    assert async_ == sync
    assert sync["reasons"] == {
        "long": "length",
        "stops": "stop",
        "cut": "stop",
        "one": "length",
        "late": "length",
    }
    assert len(sync["tokens"]["stops"]) == 4 and len(sync["tokens"]["one"]) == 1


def test_async_never_schedules_past_max_tokens():
    s = make_scheduler()
    s.add_request(make_request("a", prompt_len=4, max_tokens=2))
    first = s.schedule()  # prefill: samples output 1
    fake_runner_output(s, first, _token_at)
    second = s.schedule()  # decodes output 2, before output 1 is back
    assert second.num_scheduled_tokens == {"a": 1}
    assert s.requests["a"].num_output_placeholders == 2
    assert s.schedule().is_empty  # output 2 is the last: nothing more until update()


@pytest.mark.parametrize("lag", [1, 2], ids=["pp2", "pp3"])
@pytest.mark.parametrize(
    "kwargs",
    [{}, {"budget": 6}, {"num_blocks": 9, "caching": False}],
    ids=["plain", "chunked", "preempting"],
)
def test_pipeline_micro_batches_give_the_same_tokens(kwargs, lag):
    """Pipeline micro-batches (`lag` + 1 steps in flight): a request whose sampled token is in
    flight is not scheduled again until it is back, so the steps in flight sample different
    requests, each step takes its share of them, and the tokens equal the synchronous order's."""
    sync = make_scheduler(**kwargs)
    _add_mix(sync)
    want = _drive(sync, 0, finish_after={"cut": 4})
    s = make_scheduler(**kwargs)
    s.num_micro_batches = lag + 1
    _add_mix(s)
    schedule, num_steps_ahead = s.schedule, []

    def checked_schedule() -> SchedulerOutput:
        waiting_for_token = {r for r, req in s.requests.items() if req.num_output_placeholders}
        out = schedule()
        assert not waiting_for_token & set(out.num_scheduled_tokens)
        num_steps_ahead.append(len(s._scheduled))
        return out

    s.schedule = checked_schedule
    assert _drive(s, lag, finish_after={"cut": 4}) == want
    if "num_blocks" not in kwargs:  # (9 blocks hold too few requests to fill every step)
        assert max(num_steps_ahead) == lag + 1  # requests spread over every step in flight


# ---- copy-on-write forks (beam search) -------------------------------------------------------


def _retained_parent(s: Scheduler, prompt_len: int) -> Request:
    """A one-token request that ran and finished, its KV retained for fork()."""
    parent = make_request("p", prompt_len=prompt_len, max_tokens=1)
    parent.retain_kv = True
    s.add_request(parent)
    fake_step(s)
    assert "p" in s.retained and "p" not in s.requests
    return parent


def _continuations(parent: Request, n: int, num_tokens: int | None = None) -> list[Request]:
    """n requests continuing the parent's first num_tokens tokens (its computed ones) by one."""
    tokens = parent.all_token_ids[: num_tokens or parent.num_computed_tokens]
    return [
        Request(f"k{i}", [*tokens, 50 + i], SamplingParams(max_tokens=1), (EOS,), 1)
        for i in range(n)
    ]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    s = make_scheduler(num_blocks=16, block_size=4)
    parent = _retained_parent(s, prompt_len=6)  # a full block and 2 tokens of a second
    full, partial = s.kv_cache.req_to_blocks["p"]
    kids = _continuations(parent, 3)
    assert s.fork("p", kids)
    blocks = [s.kv_cache.req_to_blocks[k.req_id] for k in kids]
    assert [b[0] for b in blocks] == [full] * 3 and blocks[0][1] is partial
    assert len({b[1].block_id for b in blocks}) == 3  # the others got blocks of their own
    assert full.ref_count == 3 and partial.ref_count == 1 and not s.retained
    out, _ = fake_step(s)
    # One token a child (a decode row each), after the copies of the partial block.
    assert out.num_scheduled_tokens == {"k0": 1, "k1": 1, "k2": 1}
    assert [new.num_computed_tokens for new in out.new_requests] == [6, 6, 6]
    assert out.block_copies == [(partial.block_id, b[1].block_id) for b in blocks[1:]]
    assert s.schedule().block_copies == []  # a copy runs once
    assert s.kv_cache.usage == 0 and s.kv_cache.stats.queries == 6  # forks are no prefix lookups


def test_fork_at_a_block_boundary_copies_nothing():
    s = make_scheduler(num_blocks=16, block_size=4)
    parent = _retained_parent(s, prompt_len=8)  # two full blocks
    shared = list(s.kv_cache.req_to_blocks["p"])
    kids = _continuations(parent, 2)
    assert s.fork("p", kids)
    out, _ = fake_step(s)
    assert out.block_copies == [] and out.num_scheduled_tokens == {"k0": 1, "k1": 1}
    assert [new.block_ids[:2] for new in out.new_requests] == [[b.block_id for b in shared]] * 2
    assert len({new.block_ids[2] for new in out.new_requests}) == 2  # each its own third block,
    # reserved by the fork: admitting a forked request never waits for the pool
    assert s.kv_cache.usage == 0


def test_fork_without_room_for_the_copies_falls_back_to_recompute():
    s = make_scheduler(num_blocks=3, block_size=4)
    parent = _retained_parent(s, prompt_len=6)  # holds 2 of the 3 blocks
    kids = _continuations(parent, 3)  # would need 2 copies: 1 block is free
    assert not s.fork("p", kids)
    assert not s.retained and all(k.num_computed_tokens == 0 for k in kids)
    out, _ = fake_step(s)
    # A prefix hit on the full block, then the partial block's 2 tokens and the new one; the
    # third child waits for a block.
    assert out.block_copies == [] and out.num_scheduled_tokens == {"k0": 3, "k1": 3}
    run_to_completion(s)
    assert s.kv_cache.usage == 0
    assert not s.kv_cache.fork(parent, kids)  # (a parent without KV forks nothing)


def test_aborting_forked_and_retained_requests_frees_everything():
    s = make_scheduler(num_blocks=16, block_size=4)
    parent = _retained_parent(s, prompt_len=6)
    kids = _continuations(parent, 3)
    for kid in kids:
        kid.retain_kv = True
    s.fork("p", kids)
    s.finish_requests(["k1", "k2"], RequestStatus.FINISHED_ABORTED)  # before their copies ran
    out, _ = fake_step(s)  # k0 runs and finishes: retained
    assert out.block_copies == [] and out.num_scheduled_tokens == {"k0": 1}
    assert "k0" in s.retained and s.kv_cache.usage > 0
    s.finish_requests(["k0"], RequestStatus.FINISHED_ABORTED)  # a retained one goes too
    assert not s.retained and s.kv_cache.usage == 0
    with pytest.raises(ValueError, match="does not continue"):
        _retained_parent(s, prompt_len=6)
        s.fork("p", [make_request("x", prompt_len=9)])


def test_retained_kv_is_reclaimed_before_anyone_waits_for_blocks():
    s = make_scheduler(num_blocks=4, block_size=4)
    parent = _retained_parent(s, prompt_len=6)  # holds 2 of the 4 blocks
    s.add_request(make_request("big", prompt_len=12, max_tokens=1))  # needs 3
    out, _ = fake_step(s)
    assert out.num_scheduled_tokens == {"big": 12}  # admitted: the retained KV went first
    assert "p" in s.retained and parent.num_computed_tokens == 0
    assert not s.fork("p", _continuations(parent, 2, num_tokens=6))  # nothing to fork from
    run_to_completion(s)  # they recompute
    assert s.kv_cache.usage == 0 and not s.retained
