"""Requests held out of scheduling while their grammars compile in the background.

The engine adds a request with its compile's future and, before each schedule, takes out those
whose grammars are ready (to queue in the scheduler, which keeps FCFS among everyone by arrival
time) and those whose compile failed (to finish with the error). The items are the engine's
own (opaque here): this folder imports nothing of the engine.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any


@dataclass
class Failed:
    """A held item whose compile failed, and why (the message a user reads)."""

    item: Any
    error: str


class GrammarWaitlist:
    def __init__(self) -> None:
        self._held: dict[str, tuple[Any, Future]] = {}  # req_id -> (item, its compile)

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._held

    @property
    def req_ids(self) -> set[str]:
        return set(self._held)

    def add(self, req_id: str, item: Any, compiled: Future) -> None:
        self._held[req_id] = (item, compiled)

    def abort(self, req_id: str) -> bool:
        """Let go of a held request (its compile goes on and is cached for the next one)."""
        return self._held.pop(req_id, None) is not None

    def take_done(self) -> tuple[list[Any], list[Failed]]:
        """(items whose grammar is ready, items whose compile failed), out of the list."""
        ready: list[Any] = []
        failed: list[Failed] = []
        for req_id, (item, compiled) in list(self._held.items()):
            if not compiled.done():
                continue
            del self._held[req_id]
            exc = compiled.exception()
            if exc is None:
                ready.append(item)
            else:
                failed.append(Failed(item, str(exc) or type(exc).__name__))
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        """Block until some held compile is done, at most `timeout_s` (an engine with nothing
        else to run waits here instead of spinning)."""
        pending = [compiled for _, compiled in self._held.values() if not compiled.done()]
        if pending and len(pending) == len(self._held):
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)
