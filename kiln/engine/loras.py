"""The engine's book of LoRA adapters: which are registered (loaded in the runner's host
memory), under which id and name, and each registration's prefix-cache root. Pure Python: the
runner reads and holds the weights (kiln.lora.model); this decides what it is asked to load
and drop."""

from __future__ import annotations

import hashlib
import itertools
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from kiln.errors import LoRAError
from kiln.lora.request import LoRARequest


@dataclass(frozen=True)
class RegisteredLoRA:
    request: LoRARequest
    # The first KV block's parent hash for this registration: a re-added id (new weights,
    # perhaps) never hits the blocks of the old one, and no two adapters share blocks.
    hash_root: bytes


class LoRARegistry:
    """Adapters by id, least recently used first. `load` and `drop` ask the executor's runner
    to read an adapter into host memory (raising LoRAError) and to let it go; `in_use` says
    whether an unfinished request names an adapter (such a one is never dropped)."""

    def __init__(
        self,
        load: Callable[[LoRARequest], None],
        drop: Callable[[int], None],
        in_use: Callable[[int], bool],
        max_cpu_loras: int | None,
    ) -> None:
        self._load, self._drop, self._in_use = load, drop, in_use
        self.max_cpu_loras = max_cpu_loras
        self.loras: OrderedDict[int, RegisteredLoRA] = OrderedDict()
        self._generations = itertools.count()

    def add(self, request: LoRARequest) -> bool:
        """Load and register an adapter; False if this id is registered already (as the same
        adapter). LoRAError: a bad adapter, or the id or name taken by another."""
        known = self.loras.get(request.lora_int_id)
        if known is not None:
            if (known.request.lora_name, known.request.lora_path) != (
                request.lora_name,
                request.lora_path,
            ):
                raise LoRAError(
                    f"LoRA id {request.lora_int_id} is already adapter "
                    f"{known.request.lora_name!r} ({known.request.lora_path}); remove it first"
                )
            self.loras.move_to_end(request.lora_int_id)
            return False
        for other in self.loras.values():
            if other.request.lora_name == request.lora_name:
                raise LoRAError(
                    f"LoRA name {request.lora_name!r} is already adapter id "
                    f"{other.request.lora_int_id}"
                )
        self._make_room()
        self._load(request)
        root = hashlib.sha256(
            f"kiln-lora:{request.lora_int_id}:{next(self._generations)}".encode()
        ).digest()
        self.loras[request.lora_int_id] = RegisteredLoRA(request, root)
        return True

    def _make_room(self) -> None:
        """Under max_cpu_loras, drop the least recently used adapter no request uses."""
        if self.max_cpu_loras is None or len(self.loras) < self.max_cpu_loras:
            return
        victim = next((i for i in self.loras if not self._in_use(i)), None)
        if victim is None:
            raise LoRAError(
                f"{len(self.loras)} LoRA adapters are loaded (max_cpu_loras) and all are in use"
            )
        self.remove(victim)

    def remove(self, lora_int_id: int) -> bool:
        """Drop a registered adapter; False if none has this id. LoRAError while an unfinished
        request uses it."""
        if lora_int_id not in self.loras:
            return False
        if self._in_use(lora_int_id):
            raise LoRAError(
                f"LoRA adapter {self.loras[lora_int_id].request.lora_name!r} (id {lora_int_id}) "
                "is in use by unfinished requests"
            )
        self._drop(lora_int_id)
        del self.loras[lora_int_id]
        return True

    def resolve(self, request: LoRARequest) -> RegisteredLoRA:
        """The registration a new request runs with: loaded now if its id is new."""
        self.add(request)
        return self.loras[request.lora_int_id]

    def ids(self) -> set[int]:
        return set(self.loras)
