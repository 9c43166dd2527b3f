"""The engine loop in its own thread, with one asyncio stream per request.

The event loop never runs model code: add/abort are commands the loop thread picks up between
steps, and each step's deltas are handed back with `call_soon_threadsafe`. If the loop dies,
every open stream ends with the error and `healthy` turns False.

The books around each step (queue times, tokens per step, the last-step snapshot, the stream
interval) are StepLoop's, shared with the engine process (kiln.engine_core), whose client has the
same surface as this class: submit/add_request/generate/abort, healthy/error, info, tokenizer,
stats, shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Protocol

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.step_loop import EngineInfo, EngineSnapshot, StepLoop, engine_info
from kiln.errors import KilnError
from kiln.lora.request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams

logger = logging.getLogger("kiln.async_engine")


class EngineDeadError(KilnError):
    """The engine loop stopped on an error; no request can complete."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    accepted: asyncio.Future  # resolved when the loop thread has queued (or rejected) the request


class StreamSource(Protocol):
    """What a RequestStream uses of the engine that made it: this module's AsyncEngine, or the
    engine process's client (kiln.engine_core.client.EngineClient)."""

    @property
    def _streams(self) -> MutableMapping[str, Any]:
        """request id -> its open stream (each engine's own stream type); a closed stream's
        entry is removed."""
        ...

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """Delta outputs of one accepted request, in order. Closing it before the last delta (or
    never iterating it) aborts the request and frees its KV blocks; closing is idempotent."""

    def __init__(self, engine: StreamSource, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self._engine = engine
        self._stream = stream
        self._finished = False
        self._closed = False
        self._error: BaseException | None = None  # met by ready(), raised by the next __anext__

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._error is not None:
            error, self._error = self._error, None
            self.close()
            raise error
        if self._finished or self._closed:
            raise StopAsyncIteration
        item = await self._stream.queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        if item.finished:
            self._finished = True
            self.close()
        return item

    def ready(self) -> list[RequestOutput]:
        """The deltas that have arrived already, in order, without waiting (the last one
        included); an error among them is raised by the next `__anext__`."""
        items: list[RequestOutput] = []
        queue = self._stream.queue
        while not (self._finished or self._closed or self._error) and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self._error = item
                break
            items.append(item)
            if item.finished:
                self._finished = True
                self.close()
        return items

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._engine._streams.pop(self.request_id, None)
        if not self._finished:
            self._engine.abort(self.request_id)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stream_interval: int = 1) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.info: EngineInfo = engine_info(engine)
        self._loop = StepLoop(engine, stream_interval)  # loop-thread only
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = False
        self.error: BaseException | None = None
        # Called (from the loop thread) once the loop has died.
        self.on_dead: Callable[[], None] | None = None
        self._thread = threading.Thread(target=self._run, name="kiln-engine-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, stream_interval: int = 1) -> AsyncEngine:
        return cls(LLMEngine(config), stream_interval)

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive()

    @property
    def stats(self) -> EngineSnapshot:
        """The engine as of its last step (replaced whole by the loop thread: no lock, no wait)."""
        return self._loop.snapshot

    @property
    def iteration_tokens(self) -> dict[int, int]:
        return self._loop.snapshot.iteration_tokens

    # ---- API used from the event loop ----------------------------------------------------

    async def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request; returns its delta stream once the engine has accepted it. Invalid
        input raises InvalidRequestError here, so a server can answer 400 before streaming
        (a LoRA adapter that cannot be loaded: LoRAError, one)."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        loop = asyncio.get_running_loop()
        stream = _Stream(loop, asyncio.Queue(), loop.create_future())
        self._streams[request_id] = stream
        if not self.healthy:  # died between the check and registering: nobody would tell us
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self._send(("add", request_id, prompt, params, priority, lora_request, stream.accepted))
        try:
            await stream.accepted  # raises InvalidRequestError from the engine thread
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)  # cancelled after the loop thread queued it
            raise
        return RequestStream(self, request_id, stream)

    add_request = submit  # the name vLLM's AsyncLLM and LLMEngine use

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Queue a request and yield its delta outputs until it finishes. Invalid input raises
        here, before anything is yielded. Leaving the iteration early aborts the request."""
        stream = await self.submit(prompt, params, request_id, priority, lora_request)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    def call(self, fn, *args):
        """Run fn(engine, *args) on the loop thread between steps; returns a future (failed
        with EngineDeadError if the loop is dead, so no caller waits forever)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.healthy:
            fut.set_exception(EngineDeadError(f"engine is not running: {self.error!r}"))
            return fut
        self._send(("call", fn, args, fut))
        return fut

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in the engine, between steps; a bad one raises LoRAError."""
        return await self.call(_add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> bool:
        return await self.call(_remove_lora, lora_int_id)

    async def list_loras(self) -> set[int]:
        return await self.call(_list_loras)

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
                if not self._loop.has_work():
                    self._loop.refresh_snapshot(force=True)  # idle: the gauges say so at once
                    self._wakeup.wait(timeout=0.5)
                    self._wakeup.clear()
                    continue
                for delta in self._loop.step():
                    self._deliver(delta.request_id, delta)
        except BaseException as exc:  # the loop must never die silently
            logger.exception("engine loop died")
            self.error = exc
            self._fail_everyone(EngineDeadError(f"engine loop died: {type(exc).__name__}: {exc}"))
            if self.on_dead is not None:
                self.on_dead()

    def _fail_everyone(self, dead: EngineDeadError) -> None:
        """End every open stream and every pending add/call with the error: nobody may hang."""
        for stream in list(self._streams.values()):
            with contextlib.suppress(RuntimeError):  # a closed event loop: nobody is listening
                stream.loop.call_soon_threadsafe(_set_exception, stream.accepted, dead)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, dead)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "call":
                fut = command[3]
                with contextlib.suppress(RuntimeError):
                    fut.get_loop().call_soon_threadsafe(_set_exception, fut, dead)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            kind = command[0]
            if kind == "add":
                _, req_id, prompt, params, priority, lora, accepted = command
                self._add(req_id, prompt, params, priority, lora, accepted)
            elif kind == "abort":
                self._abort(command[1])
            elif kind == "call":
                _, fn, args, fut = command
                try:
                    result = fn(self.engine, *args)
                    fut.get_loop().call_soon_threadsafe(_set_result, fut, result)
                except Exception as exc:
                    fut.get_loop().call_soon_threadsafe(_set_exception, fut, exc)

    def _add(self, req_id, prompt, params, priority, lora, accepted: asyncio.Future) -> None:
        loop = accepted.get_loop()
        if req_id not in self._streams:  # the client left before we got to it
            return
        try:
            self._loop.add(req_id, prompt, params, priority, lora)
        except Exception as exc:
            loop.call_soon_threadsafe(_set_exception, accepted, exc)
            return
        loop.call_soon_threadsafe(_set_result, accepted, None)

    def _abort(self, req_id: str) -> None:
        """Abort in the engine; a stream still listening (a server-side abort, e.g. the drain
        deadline) gets a last delta with finish_reason "abort" instead of waiting forever."""
        for item in self._loop.abort(req_id):
            self._deliver(req_id, item)

    def _deliver(self, req_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(req_id)
        if stream is None:
            if isinstance(item, RequestOutput) and not item.finished:
                self._abort(req_id)  # nobody is listening any more
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening
            self._streams.pop(req_id, None)
            if isinstance(item, RequestOutput) and not item.finished:
                self._abort(req_id)


def _add_lora(engine: LLMEngine, lora_request: LoRARequest) -> bool:
    return engine.add_lora(lora_request)


def _remove_lora(engine: LLMEngine, lora_int_id: int) -> bool:
    return engine.remove_lora(lora_int_id)


def _list_loras(engine: LLMEngine) -> set[int]:
    return set(engine.list_loras())


def _set_result(fut: asyncio.Future, value: object) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
