"""Admission and shutdown: the bounded waiting queue, and the SIGTERM drain.

"Waiting" counts sequences (an engine request's n completions each) submitted that have not
produced their first token yet (queued or prefilling): what a burst of clients piles up, and what
memory and work grow with. Beyond `max_waiting`, new work gets 503 at once instead of an unbounded
queue; one request asking for more than `max_seqs_per_request` sequences gets a 400.

On drain, new work gets 503, in-flight requests may finish within the grace period, and those
still running at the deadline are aborted (their streams end with finish_reason "abort").
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import uvicorn

from kiln.errors import InvalidRequestError
from kiln.server.errors import APIError

logger = logging.getLogger("kiln.server")


class Lifecycle:
    def __init__(self, max_waiting: int, max_seqs_per_request: int | None = None) -> None:
        self.max_waiting = max_waiting
        self.max_seqs_per_request = max_seqs_per_request or max_waiting
        self.draining = False
        self.num_waiting = 0  # sequences
        self.in_flight: set[str] = set()  # engine request ids, from submission to their end

    def admit(self, num_seqs: int, check_queue: bool = True) -> None:
        """Raise 400 if one request asks for more than `max_seqs_per_request` sequences, 503
        unless `num_seqs` more sequences may queue now (`check_queue`)."""
        if num_seqs > self.max_seqs_per_request:
            raise InvalidRequestError(
                f"this request asks for {num_seqs} sequences (prompts x n), more than this "
                f"server takes in one request ({self.max_seqs_per_request})",
                param="n",
            )
        if not check_queue:
            return
        if self.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        if self.num_waiting + num_seqs > self.max_waiting:
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
            await self.abort_all(abort)

    async def abort_all(self, abort: Callable[[str], None], wait_s: float = 2.0) -> None:
        """Abort every request in flight and give their streams `wait_s` to send their last
        events (finish_reason "abort", then [DONE]) before the server closes."""
        self.draining = True
        for req_id in list(self.in_flight):
            abort(req_id)
        deadline = time.monotonic() + wait_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, but the first SIGTERM/SIGINT drains instead of closing the sockets: a
    client that connects during the drain gets a 503 it can act on, not a refused connection."""

    def __init__(
        self,
        config: uvicorn.Config,
        drain: Callable[[], Awaitable[None]],
        abort_all: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        super().__init__(config)
        self.drain = drain  # waits out (or aborts) the in-flight requests
        self.abort_all = abort_all  # a second signal: abort them now, let them say so, exit
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._aborting = False
        self.engine_dead = False

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        # Our handlers are installed now: a signal held back while the process started (one of
        # several API processes blocks them until here) is handled as a drain.
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})

    def handle_exit(self, sig: int, frame: object) -> None:
        # Not uvicorn's handler: it re-raises the signal after shutdown, and a re-raised
        # SIGTERM would end the process with -15 instead of 0.
        if self._loop is None or self._aborting or (self._draining and self.abort_all is None):
            self.should_exit = self.force_exit = True
            return
        if self._draining:  # the second signal: streams still end with their last event
            self._aborting = True
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._abort_all()))
            return
        self._draining = True
        self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    def engine_died(self) -> None:
        """The engine is gone (called from its thread): let the open streams send their error
        events, then exit (with status 1, see kiln serve) rather than serve nothing."""
        self.engine_dead = True
        loop = self._loop
        if loop is not None:
            loop.call_soon_threadsafe(
                lambda: loop.call_later(1.0, setattr, self, "should_exit", True)
            )

    async def _drain(self) -> None:
        await self.drain()
        self.should_exit = True

    async def _abort_all(self) -> None:
        assert self.abort_all is not None  # handle_exit aborts only with one
        await self.abort_all()
        self.should_exit = True
