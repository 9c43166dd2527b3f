"""The LoRA slot book (pure Python): adapters resident while used, the least recently used idle
one evicted, and the scheduler holding back requests whose adapter finds no slot."""

from __future__ import annotations

from kiln.engine.request import Request
from kiln.engine.scheduler import Scheduler
from kiln.kv_cache.manager import KVCacheManager
from kiln.lora.slots import LoRASlots
from kiln.sampling_params import SamplingParams


def test_resident_adapters_keep_their_slot_and_the_lru_idle_one_goes():
    slots = LoRASlots(2)
    assert slots.acquire(7) == slots.acquire(7)  # two requests, one slot
    slot_8 = slots.acquire(8)
    assert slots.take_loads() == [(slots.slot_of[7], 7), (slot_8, 8)]
    assert not slots.can_acquire(9)  # both in use
    slots.release(8)
    slots.release(7)
    slots.release(7)  # 8 idle first, then 7: 8 is the least recently used
    assert slots.can_acquire(9)
    assert slots.acquire(9) == slot_8 and 8 not in slots.slot_of
    assert slots.acquire(7) == slots.slot_of[7]  # still resident: no load
    assert slots.take_loads() == [(slot_8, 9)]


def test_forget_frees_the_slot():
    slots = LoRASlots(1)
    slots.acquire(3)
    slots.release(3)
    slots.forget(3)
    assert slots.slot_of == {} and slots.acquire(4) == 0
    assert slots.take_loads() == [(0, 4)]  # the removed adapter's queued load went with it


def _request(req_id: str, lora: int | None) -> Request:
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    return Request(req_id, [1, 2, 3], params, (2,), 2, lora_int_id=lora)


def test_scheduler_runs_at_most_max_loras_adapters_and_passes_over_the_others():
    slots = LoRASlots(1)
    scheduler = Scheduler(
        KVCacheManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, max_model_len=32,
        lora_slots=slots,
    )  # fmt: skip
    for req_id, lora in [("a", 1), ("b", 2), ("c", None), ("d", 1)]:
        scheduler.add_request(_request(req_id, lora))
    out = scheduler.schedule()
    # "b" waits for the slot adapter 1 holds; the base's and adapter 1's requests run.
    assert set(out.num_scheduled_tokens) == {"a", "c", "d"}
    assert out.lora_loads == [(0, 1)]
    assert [n.lora_int_id for n in out.new_requests] == [1, None, 1]
    scheduler.finish_requests(["a", "d"], scheduler.requests["a"].status.FINISHED_ABORTED)
    out = scheduler.schedule()
    assert "b" in out.num_scheduled_tokens and out.lora_loads == [(0, 2)]
