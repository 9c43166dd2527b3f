"""The engine loop in its own thread, with one asyncio stream per request.

The event loop never runs model code: add/abort are commands the loop thread picks up between
steps, and each step's deltas are handed back with `call_soon_threadsafe`. If the loop dies,
every open stream ends with the error and `healthy` turns False.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.errors import KilnError
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger("kiln.async_engine")


class EngineDeadError(KilnError):
    """The engine loop stopped on an error; no request can complete."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.error: BaseException | None = None
        self.last_step_time = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kiln-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncEngine:
        return cls(LLMEngine(config))

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    # ---- API used from the event loop ----------------------------------------------------

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its delta outputs until it finishes. Invalid input raises
        here, before anything is yielded. Leaving the iteration early aborts the request."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue())
        accepted: asyncio.Future = loop.create_future()
        self._streams[request_id] = stream
        self._send(("add", request_id, prompt, params, priority, accepted))
        try:
            await accepted  # raises InvalidRequestError from the engine thread
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call(self, fn, *args):
        """Run fn(engine, *args) on the loop thread between steps; returns a future."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._send(("call", fn, args, fut))
        return fut

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop = True
        self._wakeup.set()
        self._thread.join(timeout)

    # ---- the loop thread -----------------------------------------------------------------

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wakeup.set()

    def _run(self) -> None:
        try:
            while not self._stop:
                self._drain_commands()
                if not self.engine.has_unfinished_requests():
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                deltas = self.engine.step()
                self.last_step_time = time.monotonic()
                for delta in deltas:
                    if delta.finished:
                        self.engine.finished_output(delta.request_id)
                    self._deliver(delta.request_id, delta)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self.error = exc
            dead = EngineDeadError(f"engine loop died: {type(exc).__name__}: {exc}")
            for req_id in list(self._streams):
                self._deliver(req_id, dead)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, req_id, prompt, params, priority, accepted = command
                self._add(req_id, prompt, params, priority, accepted)
            elif kind == "abort":
                self.engine.abort_request(command[1])
            elif kind == "call":
                _, fn, args, fut = command
                try:
                    result = fn(self.engine, *args)
                    fut.get_loop().call_soon_threadsafe(_set_result, fut, result)
                except Exception as exc:
                    fut.get_loop().call_soon_threadsafe(_set_exception, fut, exc)

    def _add(self, req_id, prompt, params, priority, accepted: asyncio.Future) -> None:
        loop = accepted.get_loop()
        if req_id not in self._streams:  # the client left before we got to it
            return
        try:
            self.engine.add_request(prompt, params, request_id=req_id, priority=priority)
        except Exception as exc:
            loop.call_soon_threadsafe(_set_exception, accepted, exc)
            return
        loop.call_soon_threadsafe(_set_result, accepted, None)

    def _deliver(self, req_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(req_id)
        if stream is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self.engine.abort_request(req_id)  # nobody is listening any more
            return
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
