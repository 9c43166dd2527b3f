"""`kiln chat` and `kiln complete` (vLLM's `vllm chat` / `vllm complete`) against a running
server: what they stream is the server's greedy reply, a conversation keeps its turns, and no
server is a one-line error."""

from __future__ import annotations

import io

import httpx
import pytest

from kiln.cli.main import main
from tests.server_harness import ServerThread, free_port

ARGS = ["--max-tokens", "6", "--temperature", "0"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from kiln.server.app import build_app
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("chat")))
    config = EngineConfig(model=path, max_model_len=256, kv_cache_memory_gb=0.02, max_num_seqs=4)
    with ServerThread(build_app(AsyncEngine(LLMEngine(config)), "tiny")) as srv:
        yield srv


def _reply(server, path: str, body: dict) -> str:
    body = {"model": "tiny", "max_tokens": 6, "temperature": 0, **body}
    choice = httpx.post(server.base_url + path, json=body, timeout=60).json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_quick_chat_and_complete_print_the_servers_reply(server, capsys):
    url = ["--url", server.base_url + "/v1"]
    assert main(["chat", *url, *ARGS, "-q", "Hello there"]) == 0
    want = _reply(server, "/v1/chat/completions", {"messages": [
        {"role": "user", "content": "Hello there"}]})  # fmt: skip
    assert capsys.readouterr().out == want + "\n"
    assert main(["complete", *url, *ARGS, "-q", "The quick brown"]) == 0
    want = _reply(server, "/v1/completions", {"prompt": "The quick brown"})
    assert capsys.readouterr().out == want + "\n"


def test_an_interactive_chat_keeps_the_conversation(server, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("first\nsecond\n"))
    assert main(["chat", "--url", server.base_url + "/v1", *ARGS, "--system-prompt", "Be"]) == 0
    lines = capsys.readouterr().out.splitlines()
    first = _reply(server, "/v1/chat/completions", {"messages": [
        {"role": "system", "content": "Be"}, {"role": "user", "content": "first"}]})  # fmt: skip
    history = [
        {"role": "system", "content": "Be"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "second"},
    ]
    second = _reply(server, "/v1/chat/completions", {"messages": history})
    assert lines[0].startswith("chatting with tiny at ")
    assert lines[1:] == [f"> {first}", f"> {second}", "> "]


def test_no_server_is_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    assert main(["chat", "--url", url, "-q", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: no server at {url}")
