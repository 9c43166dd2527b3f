"""Which adapters hold the device's LoRA slots (pure Python: the scheduler's side).

An adapter is resident in one of `max_loras` slots while any running request uses it; an idle
resident adapter keeps its slot (a later request needs no copy) until a slot is wanted for
another, the least recently used idle one first. Every placement is queued as a (slot, adapter
id) load the next step's runner performs before its forward (SchedulerOutput.lora_loads); the
runner copies the adapter from its host copy into the slot's preallocated rows in place."""

from __future__ import annotations

from collections import Counter, OrderedDict


class LoRASlots:
    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.slot_of: dict[int, int] = {}  # resident adapter id -> its slot
        self._free = list(range(max_loras - 1, -1, -1))
        self._users: Counter[int] = Counter()  # resident adapter id -> running requests using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # resident, unused: LRU first
        self._loads: list[tuple[int, int]] = []

    def can_acquire(self, lora_int_id: int) -> bool:
        """Whether a request of this adapter may run now (resident, or a slot to put it in)."""
        return lora_int_id in self.slot_of or bool(self._free) or bool(self._idle)

    def acquire(self, lora_int_id: int) -> int:
        """One more running request of this adapter: its slot, placed (and its load queued)
        if it was not resident, evicting the least recently used idle adapter if need be."""
        slot = self.slot_of.get(lora_int_id)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            else:
                victim, _ = self._idle.popitem(last=False)  # KeyError: no slot (can_acquire)
                slot = self.slot_of.pop(victim)
            self.slot_of[lora_int_id] = slot
            self._loads.append((slot, lora_int_id))
        self._idle.pop(lora_int_id, None)
        self._users[lora_int_id] += 1
        return slot

    def release(self, lora_int_id: int) -> None:
        """A running request of this adapter stopped running (finished or preempted)."""
        self._users[lora_int_id] -= 1
        if self._users[lora_int_id] <= 0:
            del self._users[lora_int_id]
            self._idle[lora_int_id] = None  # most recently used

    def in_use(self, lora_int_id: int) -> bool:
        return self._users[lora_int_id] > 0

    def forget(self, lora_int_id: int) -> None:
        """The adapter was removed: its slot (if it holds one; never while in use) is free."""
        assert not self.in_use(lora_int_id), "a removed adapter has no running request"
        slot = self.slot_of.pop(lora_int_id, None)
        self._idle.pop(lora_int_id, None)
        self._loads = [(s, i) for s, i in self._loads if i != lora_int_id]
        if slot is not None:
            self._free.append(slot)

    def take_loads(self) -> list[tuple[int, int]]:
        """The (slot, adapter id) loads queued since the last call, in order."""
        loads, self._loads = self._loads, []
        return loads
