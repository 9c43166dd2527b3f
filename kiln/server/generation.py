"""The engine requests behind one HTTP request: submit them all, merge their delta streams, keep
the waiting-queue and in-flight books and the latency metrics, and abort whatever is left when the
client goes away. Shared by /v1/completions (one engine request per prompt) and chat."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import orjson
from starlette.requests import Request

from kiln.engine.async_engine import RequestStream
from kiln.errors import InvalidRequestError
from kiln.lora.request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.server.lifecycle import Lifecycle
from kiln.server.metrics import RequestTimer, ServerMetrics
from kiln.server.state import ServedEngine

T = TypeVar("T")
SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: dict) -> bytes:
    """One SSE frame, the JSON built by orjson straight from the dict (no pydantic model, no
    str round trip): the per-token cost of a stream. Non-finite floats become null."""
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS) + b"\n\n"


class ChunkFrames:
    """The SSE frames of one streamed response, whose every chunk repeats the same head (id,
    object, created, model) before its `choices`: the head is serialized once, not per token."""

    def __init__(self, head: dict) -> None:
        encoded = orjson.dumps({**head, "choices": []})  # ...,"choices":[]}
        self._prefix = b"data: " + encoded[:-2]

    def chunk(self, choice: dict) -> bytes:
        """The frame of `{**head, "choices": [choice]}`, byte for byte as `sse` writes it."""
        return self._prefix + orjson.dumps(choice, option=orjson.OPT_NON_STR_KEYS) + b"]}\n\n"


async def close_later(gen: Generation) -> None:
    """A response's background task: close the generation on the event loop (a plain function
    there would run on a worker thread, a thread-pool hop per request and off the loop that
    owns the books)."""
    gen.close()


@dataclass(frozen=True)
class EngineRequest:
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    lora_request: LoRARequest | None = None  # None: the base model


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


class Generation:
    """Use `await Generation.start(...)`, iterate `deltas()`, and always `close()` (idempotent):
    closing aborts unfinished engine requests and frees their KV blocks."""

    def __init__(
        self, engine: ServedEngine, lifecycle: Lifecycle, metrics: ServerMetrics, n: int
    ) -> None:
        self.engine = engine
        self.lifecycle = lifecycle
        self.metrics = metrics
        self.requests: list[EngineRequest] = []
        self.streams: list[RequestStream] = []
        self._timers: list[RequestTimer] = []
        self._started: list[set[int]] = []  # per request: completions that have a token
        self._done: list[bool] = []
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._admitted = False  # every request accepted: from here on, an early end is an abort
        self._failed = False  # the engine failed: its requests were not aborted, they died

    @classmethod
    async def start(
        cls,
        engine: ServedEngine,
        lifecycle: Lifecycle,
        metrics: ServerMetrics,
        requests: list[EngineRequest],
    ) -> Generation:
        """Submit every request at once (the engine thread takes them in one go, so a list of
        prompts is scheduled together rather than one step each). One the engine rejects
        (InvalidRequestError) rejects them all before any response byte is sent; the accepted
        ones are aborted, nothing stays queued."""
        lifecycle.admit(sum(r.params.n for r in requests))
        gen = cls(engine, lifecycle, metrics, len(requests))
        for r in requests:
            gen.requests.append(r)
            gen._timers.append(RequestTimer(metrics, len(r.prompt_token_ids), r.params.n))
            gen._started.append(set())
            gen._done.append(False)
            lifecycle.num_waiting += r.params.n
            lifecycle.in_flight.add(r.req_id)
        tasks = [
            asyncio.ensure_future(
                engine.submit(r.prompt_token_ids, r.params, r.req_id, r.priority, r.lora_request)
            )
            for r in requests
        ]
        interrupted = True
        try:
            await asyncio.wait(tasks)
            interrupted = False
        finally:
            for task in tasks:
                task.cancel()  # only those still waiting: they withdraw their own requests
            done = [t for t in tasks if t.done() and not t.cancelled()]
            gen.streams = [t.result() for t in done if t.exception() is None]
            failure = next((t.exception() for t in done if t.exception() is not None), None)
            if interrupted or failure is not None or len(gen.streams) < len(tasks):
                gen.close()  # aborts the accepted ones
        if failure is not None:
            raise failure
        for r in requests:
            metrics.admitted(len(r.prompt_token_ids), r.params)
        gen._admitted = True
        return gen

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(request index, delta) in arrival order until every request has finished. An engine
        failure is raised here (EngineDeadError)."""
        try:
            async for batch in self.batches():
                for item in batch:
                    yield item
        finally:
            self.close()

    async def batches(self) -> AsyncIterator[list[tuple[int, RequestOutput]]]:
        """As `deltas()`, but every delta that has arrived by the time the caller asks comes in
        one list: a response that fell behind (its event loop busy with other streams) catches
        up in one socket write rather than one per token, as vLLM merges the outputs a slow
        consumer has not taken yet. When the loop keeps up, each list holds one delta."""
        if len(self.streams) == 1:  # one engine request (chat, one prompt): no merge needed
            stream = self.streams[0]
            try:
                async for delta in stream:
                    batch = [(0, delta)] + [(0, d) for d in stream.ready()]
                    for index, d in batch:
                        self._observe(index, d)
                    yield batch
            except Exception:
                self._failed = True
                raise
            finally:
                self.close()
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream: RequestStream) -> None:
            try:
                async for delta in stream:
                    queue.put_nowait((index, delta))
                queue.put_nowait((index, None))
            except Exception as exc:
                queue.put_nowait((index, exc))

        self._tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        remaining = len(self.streams)
        try:
            while remaining:
                arrived = [await queue.get()]
                while not queue.empty():
                    arrived.append(queue.get_nowait())
                batch = []
                for index, item in arrived:
                    if item is None:
                        remaining -= 1
                        continue
                    if isinstance(item, Exception):
                        if batch:
                            yield batch  # what arrived before the failure, first
                        self._failed = True
                        raise item
                    self._observe(index, item)
                    batch.append((index, item))
                if batch:
                    yield batch
        finally:
            self.close()

    def _observe(self, index: int, delta: RequestOutput) -> None:
        failed = next((o for o in delta.outputs if o.finish_reason == "error"), None)
        if failed is not None:  # its grammar failed to compile: this request is an error
            self._release(index)
            raise InvalidRequestError(failed.error or "the request failed", param=None)
        self._timers[index].on_delta(delta)
        started = self._started[index]
        for o in delta.outputs:  # a sequence stops waiting with its first token (or its end)
            if o.index not in started and (o.token_ids or o.finish_reason is not None):
                started.add(o.index)
                self.lifecycle.num_waiting -= 1
        if delta.finished:
            self._release(index)

    def _release(self, index: int) -> None:
        if self._done[index]:
            return
        self._done[index] = True
        n = self.requests[index].params.n
        self.lifecycle.num_waiting -= n - len(self._started[index])
        self._started[index].update(range(n))
        self.lifecycle.in_flight.discard(self.requests[index].req_id)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._admitted and not self._failed:
            for timer in self._timers:
                timer.abandon()  # counts the unfinished completions as aborted
        for task in self._tasks:
            task.cancel()
        for stream in self.streams:
            stream.close()  # aborts the unfinished ones
        for index in range(len(self.requests)):
            self._release(index)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, but give up (cancelling it) if the client disconnects first: a non-streaming
    request whose client left must not keep its KV blocks until it completes."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task.done():
            return work_task.result()
        work_task.cancel()
        await asyncio.wait({work_task})  # let its cleanup (the aborts) run
        raise ClientDisconnected()
    finally:
        watch_task.cancel()
        work_task.cancel()


async def _wait_disconnect(request: Request) -> None:
    # The body has been read: the next message the server sends is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
