"""Admission and shutdown: the bounded waiting queue, and the SIGTERM drain.

"Waiting" counts engine requests submitted that have not produced their first token yet (queued
or prefilling): what a burst of clients piles up, and what memory grows with. Beyond
`max_waiting`, new work gets 503 at once instead of an unbounded queue.

On drain, new work gets 503, in-flight requests may finish within the grace period, and those
still running at the deadline are aborted (their streams end with finish_reason "abort").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import uvicorn

from kiln.server.errors import APIError

logger = logging.getLogger("kiln.server")


class Lifecycle:
    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self.draining = False
        self.num_waiting = 0
        self.in_flight: set[str] = set()  # engine request ids, from submission to their end

    def admit(self, num_requests: int) -> None:
        """Raise 503 unless `num_requests` more engine requests may queue now."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.num_waiting + num_requests > self.max_waiting:
            raise APIError(
                503,
                f"too many requests waiting ({self.num_waiting} queued, limit "
                f"{self.max_waiting}): retry later",
                code="server_overloaded",
            )

    async def drain(self, grace_s: float, abort: Callable[[str], None]) -> None:
        """Stop admitting, wait up to `grace_s` for in-flight requests, abort the rest."""
        self.draining = True
        logger.warning("draining: %d requests in flight, grace %.1fs", len(self.in_flight), grace_s)
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.in_flight:
            logger.warning("grace period over: aborting %d requests", len(self.in_flight))
            for req_id in list(self.in_flight):
                abort(req_id)
            # Let the aborted streams send their last events before the server closes.
            deadline = time.monotonic() + 2.0
            while self.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, but the first SIGTERM/SIGINT drains instead of closing the sockets: a
    client that connects during the drain gets a 503 it can act on, not a refused connection."""

    def __init__(self, config: uvicorn.Config, drain: Callable[[], Awaitable[None]]) -> None:
        super().__init__(config)
        self.drain = drain  # waits out (or aborts) the in-flight requests
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not uvicorn's handler: it re-raises the signal after shutdown, and a re-raised
        # SIGTERM would end the process with -15 instead of 0.
        if self._draining or self._loop is None:
            self.should_exit = self.force_exit = True
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        await self.drain()
        self.should_exit = True
