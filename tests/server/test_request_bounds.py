"""No single request stalls the server: every field a chat template may render counts toward the
size bound, and templating runs off the event loop, so /health answers within a second while a
request with megabytes of tools or tool-call arguments is turned away (issue 57's attack, made
small: a tiny model whose Hermes-style template renders tools, tests/tiny_tokenizer.py)."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server_harness import ServerThread

TOOL = {
    "type": "function",
    "function": {"name": "f", "description": "", "parameters": {"type": "object"}},
}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from kiln.server.app import build_app
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-bounds")))
    config = EngineConfig(model=path, max_model_len=512, kv_cache_memory_gb=0.05, max_num_seqs=4)
    engine = AsyncEngine(LLMEngine(config))
    with (
        ServerThread(build_app(engine, "tiny")) as srv,
        httpx.Client(base_url=srv.base_url, timeout=120) as client,
    ):
        yield client
    engine.shutdown()


def _health_while(http: httpx.Client, body: dict) -> tuple[httpx.Response, float, float]:
    """POST `body` to chat completions while probing /health: the response, the request's
    seconds and the slowest /health."""
    content = json.dumps(body).encode()
    result: dict = {}

    def post() -> None:
        t0 = time.monotonic()
        result["response"] = http.post(
            "/v1/chat/completions", content=content, headers={"content-type": "application/json"}
        )
        result["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=post)
    worker.start()
    slowest = 0.0
    while worker.is_alive():
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.02)
    worker.join()
    return result["response"], result["seconds"], slowest


def _big_tools(num_bytes: int) -> list[dict]:
    description = "lorem ipsum dolor sit amet " * 400
    tool = {**TOOL, "function": {**TOOL["function"], "description": description}}
    return [tool] * (num_bytes // len(description))


def test_megabytes_of_tools_count_toward_the_bound_and_health_answers(http):
    ask = [{"role": "user", "content": "hi"}]
    response, seconds, slowest = _health_while(
        http, {"messages": ask, "tools": _big_tools(3 << 20), "max_tokens": 1}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.0, slowest
    assert seconds < 5.0, seconds  # before: rendered and tokenized in full on the loop


def test_megabytes_of_tool_call_arguments_count_toward_the_bound(http):
    arguments = json.dumps({"x": "lorem ipsum dolor sit amet " * (3 << 15)})
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call] * 1},
        {"role": "tool", "tool_call_id": "c", "content": "ok"},
    ]
    response, _, slowest = _health_while(http, {"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["code"] == "context_length_exceeded"
    assert slowest < 1.0, slowest


def test_a_slow_template_runs_off_the_loop(http, monkeypatch):
    # A template may take seconds over a short conversation; the loop must not wait for it.
    from kiln.server import chat

    real = chat.template_message

    def slow(message):
        time.sleep(1.5)
        return real(message)

    monkeypatch.setattr(chat, "template_message", slow)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    response, _, slowest = _health_while(http, body)
    assert response.status_code == 200, response.text
    assert slowest < 1.0, slowest


def test_a_small_request_with_tools_still_runs(http):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "max_tokens": 2}
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
