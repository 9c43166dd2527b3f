"""Regression tests for the defects a tester found in the server (issue 15): each failed on the
code before the fix."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from kiln.config import EngineConfig
from kiln.engine.async_engine import AsyncEngine
from kiln.engine.llm_engine import LLMEngine
from kiln.server.app import build_app
from tests.conftest import build_tiny_hf_model
from tests.server_harness import MODEL_NAME, ServerThread, shared_engine


@pytest.fixture(scope="module")
def http():
    app = build_app(shared_engine(), MODEL_NAME, max_waiting=1024)
    with ServerThread(app) as srv, httpx.Client(base_url=srv.base_url, timeout=120) as client:
        yield client


def _raw(http: httpx.Client, path: str, body: str) -> httpx.Response:
    return http.post(path, content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "a\\ud800b"], "max_tokens": 1}', "prompt"),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}',
            "messages",
        ),
        ("/tokenize", '{"prompt": "a\\udfffb"}', "prompt"),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 1}', "model"),
        # Issue 57: every other string a request carries (each was a 500 before).
        ("/v1/completions", '{"prompt": "hi", "stop": ["\\ud800"], "max_tokens": 1}', "stop"),
        ("/v1/completions", '{"prompt": "hi", "guided_regex": "a\\udc00"}', "guided_regex"),
        ("/v1/completions", '{"prompt": "hi", "guided_choice": ["\\ud800"]}', "guided_choice"),
        (
            "/v1/completions",
            '{"prompt": "hi", "guided_json": {"type": "object", "properties": {"\\ud800": {}}}}',
            "guided_json",
        ),
        (
            "/v1/chat/completions",
            '{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", '
            '"function": {"name": "f\\ud800"}}], "max_tokens": 1}',
            "tools",
        ),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(http, path, body, param):
    response = _raw(http, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_an_escaped_surrogate_pair_is_text_not_an_error(http):
    body = '{"prompt": "\\ud83d\\ude00 \\\\ud800", "stop": ["\\ud83d\\ude00"], "max_tokens": 1}'
    response = _raw(http, "/v1/completions", body)  # an emoji, and "\\ud800" as plain text
    assert response.status_code == 200, response.text


def test_a_lone_surrogate_in_kserve_text_input_is_a_400(http):
    body = '{"text_input": "a\\ud800", "max_tokens": 1}'
    response = _raw(http, "/v2/models/ensemble/generate", body)
    assert response.status_code == 400, response.text
    assert "text_input" in response.json()["error"]


def test_an_over_long_prompt_is_rejected_by_its_size_without_freezing_the_server(http):
    huge = "lorem ipsum dolor sit amet " * 300_000  # 8 MB: seconds of tokenizing
    result: dict = {}

    def post() -> None:
        t0 = time.monotonic()
        result["response"] = http.post("/v1/completions", json={"prompt": huge, "max_tokens": 1})
        result["seconds"] = time.monotonic() - t0

    worker = threading.Thread(target=post)
    worker.start()
    health_times = []
    while worker.is_alive():
        t0 = time.monotonic()
        assert http.get("/health").status_code == 200
        health_times.append(time.monotonic() - t0)
        time.sleep(0.05)
    worker.join()
    assert result["response"].status_code == 400
    assert result["response"].json()["error"]["param"] == "prompt"
    assert "context" in result["response"].json()["error"]["message"]
    assert result["seconds"] < 3.0, result  # before: tokenized in full first (tens of seconds)
    assert max(health_times, default=0) < 1.0


def test_thousands_of_chat_messages_are_rejected_before_the_template(http):
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}] * 1500
    t0 = time.monotonic()
    response = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "messages"
    assert time.monotonic() - t0 < 2.0


def test_admission_counts_sequences_with_a_per_request_cap(http):
    response = http.post(
        "/v1/completions", json={"prompt": ["Hi"] * 256, "n": 128, "max_tokens": 1}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and "32768 sequences" in error["message"]
    # Token-id prompts count the same way.
    response = http.post(
        "/v1/completions", json={"prompt": [[1, 2]] * 16, "n": 128, "max_tokens": 1}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


def test_max_tokens_above_the_context_is_a_400_as_vllm(http):
    context = http.get("/v1/models").json()["data"][0]["max_model_len"]
    response = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": context})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "max_tokens"
    assert f"maximum context length is {context}" in response.json()["error"]["message"]
    chat = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": context}
    response = http.post("/v1/chat/completions", json=chat)
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"


def test_405_keeps_its_allow_header(http):
    response = http.get("/v1/completions")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"


def test_a_negative_token_id_says_what_is_wrong(http):
    response = http.post("/v1/completions", json={"prompt": [5, -1], "max_tokens": 1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "greater than or equal to 0" in message and "-1" in message, message


@pytest.mark.parametrize("path", ["/tokenize", "/v1/chat/completions"])
def test_a_malformed_earlier_tool_call_is_a_400(http, path):
    # The fuzzer's find (a 500: the template's copy of `function` took dict(True)).
    calls = [{"function": True}]
    messages = [{"role": "assistant", "content": None, "tool_calls": calls}]
    response = http.post(path, json={"messages": messages, "max_tokens": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "messages" and "got True" in error["message"], error
    # A well-formed one still goes through to the template.
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": calls}]
    assert http.post(path, json={"messages": messages, "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"prompt": "", "max_tokens": 1},
        {"prompt": [], "max_tokens": 1},
        {"prompt": "hi", "max_tokens": 1, "echo": 0},
    ],
)
def test_the_schema_and_the_server_reject_the_same_completions(http, body):
    import jsonschema

    assert http.post("/v1/completions", json=body).status_code == 400
    spec = http.get("/openapi.json").json()
    schema = {
        **spec["components"]["schemas"]["CompletionRequest"],
        "components": spec["components"],
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)


def test_the_schema_says_top_logprobs_needs_logprobs(http):
    import jsonschema

    body = {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}
    assert http.post("/v1/chat/completions", json=body).status_code == 400
    spec = http.get("/openapi.json").json()
    schema = {
        **spec["components"]["schemas"]["ChatCompletionRequest"],
        "components": spec["components"],
    }
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(body, schema, cls=jsonschema.Draft202012Validator)
    jsonschema.validate({**body, "logprobs": True}, schema, cls=jsonschema.Draft202012Validator)


@pytest.mark.timeout(120)
def test_metrics_answer_at_once_from_the_last_step_during_a_long_step(tmp_path):
    build_tiny_hf_model("llama-gqa", str(tmp_path))
    core = LLMEngine(EngineConfig(model=str(tmp_path), kv_cache_memory_gb=0.05))
    real_step, slow = core.step, threading.Event()

    def step():
        if slow.is_set():
            time.sleep(3.0)  # a long prefill, as seen from the server
        return real_step()

    core.step = step
    engine = AsyncEngine(core)
    try:
        with ServerThread(build_app(engine, "tiny")) as srv:
            # Long enough to still run 0.8 s in on a quiet host (the tiny model holds 512).
            body = {"prompt": [5, 6, 7], "max_tokens": 480, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.base_url + "/v1/completions", json=body) as response:
                lines = response.iter_lines()
                next(lines)
                next(lines)
                time.sleep(0.3)  # a snapshot taken while it runs
                slow.set()
                time.sleep(0.5)  # now inside a 3 s step
                t0 = time.monotonic()
                text = httpx.get(srv.base_url + "/metrics", timeout=10).text
                took = time.monotonic() - t0
                slow.clear()
            assert took < 1.0, took  # before: waited for the step (up to 5 s), then stale
            running = [
                line for line in text.splitlines() if line.startswith("kiln:num_requests_running")
            ]
            assert running and float(running[0].split()[-1]) == 1.0, running
    finally:
        engine.shutdown()
