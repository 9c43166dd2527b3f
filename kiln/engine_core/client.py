"""EngineClient: the AsyncEngine's surface over an engine process.

The API process binds two ZMQ sockets (PUSH requests, PULL outputs) on ipc:// paths in a private
temp directory and starts `python -m kiln.engine_core.process` (EngineProcess). With several API
processes (`kiln serve --api-server-count N`) the launcher starts the engine process for all of
them, and each API process attaches to its own pair of addresses (`EngineClient.attach`).

Sends happen on the caller's thread (under a lock); one reader thread decodes each step's
Outputs and hands it to the event loops of the streams it concerns with a single
`call_soon_threadsafe` per loop, so the event loop does per-delta work only in its own callbacks.

If the engine process dies (a failed step, a kill, a crash), every open stream ends with
EngineDeadError, `healthy` turns False, and `on_dead` is called (kiln serve exits on it).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import msgspec
import zmq

from kiln.config import EngineConfig
from kiln.engine.async_engine import (
    EngineDeadError,
    RequestStream,
    _set_exception,
    _set_result,
    _Stream,
)
from kiln.engine.step_loop import EngineInfo, EngineSnapshot
from kiln.engine_core import messages as m
from kiln.engine_core.parent_watch import kill_with_parent_thread
from kiln.errors import InvalidRequestError, KilnError, LoRAError
from kiln.lora.request import LoRARequest
from kiln.outputs import RequestOutput
from kiln.sampling_params import SamplingParams
from kiln.tokenizer import Tokenizer

logger = logging.getLogger("kiln.engine_core")
# How long a send may wait for an engine to take it (it waits only when none is connected).
SEND_TIMEOUT_MS = 5000


class EngineStartupError(KilnError):
    """The engine process could not start; the message is the engine's own reason."""


class StartupCancelled(Exception):
    """The start's `cancel` event was set: the engine process was stopped before it was ready."""


@dataclass
class _ClientStream(_Stream):
    prompt_token_ids: list[int]


@dataclass(frozen=True)
class ClientAddresses:
    """One API process's pair of ZMQ addresses; the API process binds both."""

    inputs: str  # requests, API -> engine
    outputs: str  # outputs, engine -> API


class EngineProcess:
    """`python -m kiln.engine_core.process` serving `num_clients` API processes, whose socket
    addresses (ipc:// in a private temp dir) are `addresses`. The engine connects; each client
    binds its pair (ZMQ reconnects, so either may come first)."""

    def __init__(self, config: EngineConfig, stream_interval: int = 1, num_clients: int = 1):
        self.dir = tempfile.mkdtemp(prefix="kiln-engine-")
        self.addresses = [
            ClientAddresses(f"ipc://{self.dir}/inputs-{i}", f"ipc://{self.dir}/outputs-{i}")
            for i in range(num_clients)
        ]
        cmd = [sys.executable, "-m", "kiln.engine_core.process"]
        for a in self.addresses:
            cmd += ["--inputs", a.inputs, "--outputs", a.outputs]
        cmd += ["--config", msgspec.json.encode(config).decode()]
        cmd += ["--stream-interval", str(stream_interval), "--parent-pid", str(os.getpid())]
        # Its own session: a terminal's Ctrl-C goes to the API process, which drains first.
        # Started from the main thread, whose exit is this process's: the kernel ends the
        # engine with it from the moment it exists (its imports alone take seconds).
        on_main = threading.current_thread() is threading.main_thread()
        self.popen = subprocess.Popen(
            cmd, start_new_session=True, preexec_fn=kill_with_parent_thread if on_main else None
        )
        self.pid = self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` for it to exit (every client sent Shutdown), then kill it."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class _ProcessWatch:
    """Whether a process that is not our child (another process started it) still runs: a pidfd
    turns readable when it exits, zombie or not, and never mistakes a reused pid for it."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # already gone

    def exit_code(self) -> int | None:
        """None while it runs; -1 once it has exited (its parent holds the real code)."""
        if self._fd is None:
            return -1
        return -1 if select.select([self._fd], [], [], 0)[0] else None

    def stop(self, timeout: float) -> None:
        """Not ours to stop: the process that started it does."""


class EngineClient:
    """Use `EngineClient.start(config)` (it starts and owns the engine process; `shutdown()`
    stops it) or `EngineClient.attach(...)` (one of several API processes over an engine process
    the launcher owns; `shutdown()` says this client is done)."""

    def __init__(
        self,
        config: EngineConfig,
        addresses: ClientAddresses,
        engine: EngineProcess | _ProcessWatch,
    ) -> None:
        self.config = config
        self.error: BaseException | None = None
        self.on_dead: Callable[[], None] | None = None
        self.stats = EngineSnapshot()
        self._streams: dict[str, _ClientStream] = {}
        self._lora_calls: dict[int, asyncio.Future] = {}  # call id -> its caller's future
        self._lora_call_ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._stop = False
        self._engine = engine
        self._ctx = zmq.Context()
        try:
            self._open_sockets(addresses, engine.pid)
        except BaseException:
            # A context left with open sockets blocks forever in its __del__'s term(). (An
            # exception from a signal handler can land inside pyzmq's socket(), before the
            # socket is registered: then this term() waits too, so `kiln serve`'s handlers
            # only note the signal, see kiln.cli.serve._StartupSignals.)
            self._ctx.destroy(linger=0)
            raise
        self._reader: threading.Thread | None = None

    def _open_sockets(self, addresses: ClientAddresses, engine_pid: int) -> None:
        # Only the engine process may connect (SO_PEERCRED): another process of this user that
        # connects would otherwise take every other request (PUSH round-robins) or feed outputs.
        self._inputs = self._ctx.socket(zmq.PUSH)
        self._inputs.setsockopt(zmq.IPC_FILTER_PID, engine_pid)
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._inputs.setsockopt(zmq.LINGER, 0)
        # With no queue limit a send waits only when no engine is connected: one that died (or
        # closed its end) would otherwise block the caller, the server's event loop, forever.
        self._inputs.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
        self._inputs.bind(addresses.inputs)
        self._outputs = self._ctx.socket(zmq.PULL)
        self._outputs.setsockopt(zmq.IPC_FILTER_PID, engine_pid)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._outputs.bind(addresses.outputs)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        stream_interval: int = 1,
        timeout: float | None = None,
        cancel: threading.Event | None = None,
    ) -> EngineClient:
        """Start the engine process and wait until it is ready (or say why it is not). Once
        `cancel` is set (a signal handler may set it, at any moment), the start stops the
        engine process at its next look (within 0.2 s) and raises StartupCancelled."""
        engine = EngineProcess(config, stream_interval)
        try:
            client = cls(config, engine.addresses[0], engine)
        except BaseException:  # KeyboardInterrupt included: no engine left loading
            engine.stop(timeout=0)
            raise
        return cls._ready(client, timeout, cancel)

    @classmethod
    def attach(
        cls,
        config: EngineConfig,
        addresses: ClientAddresses,
        engine_pid: int,
        timeout: float | None = None,
    ) -> EngineClient:
        """Connect to an engine process another process started, at this client's addresses,
        and wait until it is ready (or say why it is not)."""
        return cls._ready(cls(config, addresses, _ProcessWatch(engine_pid)), timeout)

    @classmethod
    def _ready(
        cls, client: EngineClient, timeout: float | None, cancel: threading.Event | None = None
    ) -> EngineClient:
        try:
            client._await_ready(timeout, cancel)
        except BaseException:
            client.shutdown(timeout=1.0)
            raise
        return client

    def _await_ready(self, timeout: float | None, cancel: threading.Event | None) -> None:
        from kiln.runtime.model_loader import find_model_source

        # The tokenizer is the API process's own (detokenizing ids for /detokenize, logprobs
        # and echo; tokenizing prompts off the engine): loaded while the engine process loads,
        # on a thread, so this one stays free to see a cancel (SIGTERM while starting stops
        # the engine process at once, not after a GGUF tokenizer's seconds of building).
        found: dict[str, Any] = {}
        self.tokenizer: Tokenizer | None = None

        def load_tokenizer() -> None:
            try:
                found["tokenizer"] = find_model_source(
                    self.config.model, self.config.load_format
                ).tokenizer
            except BaseException as exc:  # the engine will say the same, better: wait for it
                found["error"] = exc

        loader = threading.Thread(target=load_tokenizer, name="kiln-tokenizer", daemon=True)
        loader.start()
        deadline = None if timeout is None else time.monotonic() + timeout

        def check_cancel() -> None:
            if cancel is not None and cancel.is_set():
                raise StartupCancelled("the engine's start was cancelled")

        while True:
            check_cancel()  # first before the poll: a signal during the fork or the binds
            if self._outputs.poll(200):
                msg = m.decode_output(self._outputs.recv())
                if isinstance(msg, m.StartupFailed):
                    raise EngineStartupError(msg.message)
                if isinstance(msg, m.Ready):
                    break
            elif (code := self._engine.exit_code()) is not None:
                raise EngineStartupError(
                    f"the engine process exited (code {code}) before it was ready (its output "
                    "is above)"
                )
            if deadline is not None and time.monotonic() > deadline:
                raise EngineStartupError(f"the engine process was not ready within {timeout}s")
        while loader.is_alive():  # joined in steps: a cancel is still seen
            check_cancel()
            loader.join(0.2)
        if "error" in found:
            raise found["error"]
        self.tokenizer = found["tokenizer"]
        self.info = EngineInfo(
            msg.max_model_len, msg.vocab_size, msg.default_params, msg.cache_config
        )
        # What code written against AsyncEngine.engine (the LLMEngine) reads of it.
        defaults = msg.default_params
        self.engine = SimpleNamespace(
            config=self.config,
            tokenizer=self.tokenizer,
            max_model_len=msg.max_model_len,
            model_config=SimpleNamespace(vocab_size=msg.vocab_size),
            default_sampling_params=lambda: dataclasses.replace(defaults),
        )
        self._reader = threading.Thread(target=self._read, name="kiln-engine-client", daemon=True)
        self._reader.start()

    @property
    def healthy(self) -> bool:
        return (
            self.error is None
            and self._engine.exit_code() is None
            and self._reader is not None
            and self._reader.is_alive()
        )

    @property
    def iteration_tokens(self) -> dict[int, int]:
        return self.stats.iteration_tokens

    # ---- API used from the event loop ----------------------------------------------------

    async def submit(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """As AsyncEngine.submit: returns the delta stream once the engine process accepted the
        request; its InvalidRequestError is raised here (a 400 before any byte is streamed)."""
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: pass token ids", "prompt")
            prompt = list(self.tokenizer.encode(prompt, add_special_tokens=True))
        params = params or self.info.default_params
        loop = asyncio.get_running_loop()
        stream = _ClientStream(loop, asyncio.Queue(), loop.create_future(), list(prompt))
        self._streams[request_id] = stream
        if not self.healthy:  # died between the check and registering: nobody would tell us
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        try:
            self._send(
                m.AddRequest(request_id, stream.prompt_token_ids, params, priority, lora_request)
            )
        except EngineDeadError:
            self._streams.pop(request_id, None)
            raise
        try:
            await stream.accepted
        except BaseException:
            self._streams.pop(request_id, None)
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    add_request = submit

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.submit(prompt, params, request_id, priority, lora_request)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        if self.healthy:
            with contextlib.suppress(EngineDeadError):  # gone: nothing left to abort
                self._send(m.Abort([request_id]))

    def call(self, fn, *args):
        raise TypeError("the engine runs in its own process: no function can be run on it")

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """As AsyncEngine.add_lora: the engine process reads and checks the adapter; a bad
        one raises LoRAError with the engine's message."""
        reply = await self._lora_call(lora=lora_request)
        return reply.result

    async def remove_lora(self, lora_int_id: int) -> bool:
        reply = await self._lora_call(remove_id=lora_int_id)
        return reply.result

    async def list_loras(self) -> set[int]:
        reply = await self._lora_call()
        return set(reply.lora_ids)

    async def _lora_call(
        self, lora: LoRARequest | None = None, remove_id: int | None = None
    ) -> m.LoRAReply:
        if not self.healthy:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        call_id = next(self._lora_call_ids)
        future = asyncio.get_running_loop().create_future()
        self._lora_calls[call_id] = future
        try:
            self._send(m.LoRACall(call_id, lora, remove_id))
            reply = await future
        finally:
            self._lora_calls.pop(call_id, None)
        if reply.error is not None:
            raise LoRAError(reply.error)
        return reply

    def shutdown(self, timeout: float = 5.0) -> None:
        """Tell the engine process this client is done (it stops once all of its clients are);
        if this client started it, wait up to `timeout` for it to exit, then kill it."""
        self._stop = True
        if self._engine.exit_code() is None:
            with contextlib.suppress(zmq.ZMQError):
                # Without waiting: a PUSH socket with no peer (an engine process that failed to
                # start has closed its end and not yet exited) blocks a send forever; `kiln
                # serve` of a missing model hung here when the engine lost that race.
                self._send(m.Shutdown(), zmq.NOBLOCK)
                # LINGER 0 drops what is unsent at close: give the Shutdown its moment.
                self._inputs.setsockopt(zmq.LINGER, 1000)
        self._engine.stop(timeout)
        if self._reader is not None:
            self._reader.join(2.0)
        self._inputs.close()
        self._outputs.close(linger=0)
        self._ctx.term()

    # ---- the reader thread ---------------------------------------------------------------

    def _send(self, msg: m.EngineInput, flags: int = 0) -> None:
        data = m.encoder.encode(msg)
        with self._send_lock:
            try:
                self._inputs.send(data, flags=flags, copy=False)
            except zmq.Again:
                if flags & zmq.NOBLOCK:
                    raise
                raise EngineDeadError(
                    f"the engine process took no input for {SEND_TIMEOUT_MS / 1000:g} s "
                    "(no engine is connected)"
                ) from None

    def _read(self) -> None:
        try:
            while not self._stop:
                if not self._outputs.poll(200):
                    code = self._engine.exit_code()
                    if code is not None and not self._outputs.poll(0):
                        raise EngineDeadError(f"the engine process exited (code {code})")
                    continue
                msg = m.decode_output(self._outputs.recv(copy=False).buffer)
                if isinstance(msg, m.Outputs):
                    self._dispatch(msg)
                elif isinstance(msg, m.LoRAReply):
                    future = self._lora_calls.get(msg.call_id)
                    if future is not None:
                        with contextlib.suppress(RuntimeError):  # its event loop is closed
                            future.get_loop().call_soon_threadsafe(_set_result, future, msg)
                elif isinstance(msg, m.EngineDied):
                    raise EngineDeadError(f"engine loop died: {msg.message}")
        except BaseException as exc:
            if self._stop:
                return
            logger.error("engine process failed: %s", exc)
            dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(repr(exc))
            self.error = dead
            self._fail_everyone(dead)
            if self.on_dead is not None:
                self.on_dead()

    def _dispatch(self, msg: m.Outputs) -> None:
        if msg.snapshot is not None:
            self.stats = msg.snapshot
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        orphans: list[str] = []
        for req_id in msg.accepted:
            stream = self._streams.get(req_id)
            if stream is None:
                orphans.append(req_id)  # withdrawn before the engine took it
            else:
                by_loop.setdefault(stream.loop, []).append((_set_result, stream.accepted, None))
        for r in msg.rejected:
            stream = self._streams.get(r.req_id)
            if stream is not None:
                exc = InvalidRequestError(r.message, r.param, r.code)
                by_loop.setdefault(stream.loop, []).append((_set_exception, stream.accepted, exc))
        for delta in msg.deltas:
            stream = self._streams.get(delta.request_id)
            if stream is None:
                if not delta.finished:
                    orphans.append(delta.request_id)  # nobody is listening any more
                continue
            delta.prompt_token_ids = stream.prompt_token_ids
            by_loop.setdefault(stream.loop, []).append((_put, stream.queue, delta))
        if orphans:
            self._send(m.Abort(orphans))
        for loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # that event loop is closed: nobody listens
                loop.call_soon_threadsafe(_apply, items)

    def _fail_everyone(self, dead: EngineDeadError) -> None:
        for future in list(self._lora_calls.values()):
            with contextlib.suppress(RuntimeError):
                future.get_loop().call_soon_threadsafe(_set_exception, future, dead)
        for stream in list(self._streams.values()):
            items = [(_set_exception, stream.accepted, dead), (_put, stream.queue, dead)]
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(_apply, items)


def _apply(items: list) -> None:
    for fn, target, value in items:
        fn(target, value)


def _put(queue: asyncio.Queue, item: object) -> None:
    queue.put_nowait(item)
