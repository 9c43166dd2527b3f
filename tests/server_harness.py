"""Helpers for the server tests: one engine per test process (loading the embedded model is the
slow part), uvicorn in a background thread on a free port, and the offline API run on the very
same engine for reference outputs."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import uvicorn

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.llm import LLM

T = TypeVar("T")
MODEL_NAME = "smollm2"
_engines: dict[str, AsyncEngine] = {}


def shared_engine() -> AsyncEngine:
    """The embedded SmolLM2 behind an AsyncEngine, loaded once per process."""
    if "smollm2" not in _engines:
        # KILN_SERVER_TEST_PARALLEL="TP,PP" (e.g. "1,2" or "3,1"): the same server tests on a
        # tensor/pipeline-parallel engine (slow on the CPU: run by hand, not in CI).
        tp, pp = (int(x) for x in os.environ.get("KILN_SERVER_TEST_PARALLEL", "1,1").split(","))
        config = EngineConfig(
            max_model_len=512,
            kv_cache_memory_gb=0.25,
            max_num_seqs=64,
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
        )
        _engines["smollm2"] = AsyncEngine(LLMEngine(config))
    return _engines["smollm2"]


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The names of the test functions of the requesting module that this session runs (after
    -m / -k deselection): a module fixture starts only what they use."""
    return {
        item.originalname
        for item in request.session.items
        if isinstance(item, pytest.Function) and item.path == request.path
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 from a daemon thread (no signal handlers there)."""

    def __init__(self, app: object) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)


def read_completion_stream(response, into) -> Iterator[dict]:
    """A streaming completion's SSE lines, recorded on `into` (its done, error_event,
    num_tokens and finish attributes); yields each chunk that is not an error event."""
    for line in response.iter_lines():
        if line == "data: [DONE]":
            into.done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                into.error_event = event["error"]
                continue
            if event.get("usage"):
                into.num_tokens = event["usage"]["completion_tokens"]
            for choice in event["choices"]:
                into.finish = choice["finish_reason"] or into.finish
            yield event


def offline(engine: AsyncEngine, fn: Callable[[LLM], T]) -> T:
    """Run `fn(llm)` with the offline `LLM` API on the server's own engine, on its loop thread
    between steps (no server request may be in flight: LLM's loop would take their outputs)."""

    def on_engine_thread(core: LLMEngine) -> T:
        llm = LLM.__new__(LLM)  # LLM without loading a second model: same engine, same weights
        llm.config, llm.engine = core.config, core
        return fn(llm)

    async def go() -> T:
        return await engine.call(on_engine_thread)

    return asyncio.run(go())


def tiny_chat_engine() -> AsyncEngine:
    """The tiny random Llama with a Hermes-style chat template (tests/tiny_tokenizer.py) behind
    an AsyncEngine, built once per process: the agent API tests (Responses, Messages) share it."""
    if "tiny-chat" not in _engines:
        import tempfile

        from tests.tiny_tokenizer import build_tiny_chat_model

        path = build_tiny_chat_model(tempfile.mkdtemp(prefix="kiln-tiny-chat-"))
        config = EngineConfig(
            model=path, max_model_len=512, kv_cache_memory_gb=0.05, max_num_seqs=8
        )
        _engines["tiny-chat"] = AsyncEngine(LLMEngine(config))
    return _engines["tiny-chat"]
