"""Anthropic's Messages API through the official anthropic SDK, streamed and not, on the tiny
random chat model served with the qwen3 reasoning parser and an API key: content blocks
(thinking, text, tool_use) from the reply parsers, tool_result turns, stop reasons, usage,
Anthropic's error shapes and x-api-key auth. A regex (vLLM's guided_regex extra) makes the random
model write a `<think>` block and a tool call."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread, tiny_chat_engine

anthropic = lazy_import("anthropic")

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
KEY = "sk-test"
WEATHER = {
    "name": "get_weather",
    "description": "Weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THINK_AND_CALL = "<think>\nI need the weather\\.\n</think>\n\nLet me check\\." + re.sub(
    r"([{}().\[\]])", r"\\\1", CALL
)
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def server():
    from kiln.server.app import build_app

    app = build_app(tiny_chat_engine(), MODEL, api_key=KEY, reasoning_parser="qwen3")
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=120)


def test_text_reply_equals_chat_completions(server, client):
    import openai

    chat = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    want = chat.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=0,
    )
    message = client.messages.create(
        model=MODEL,
        system="Be brief.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        max_tokens=12,
        extra_body={"temperature": 0},  # this SDK takes no sampling arguments: sent as extras
    )
    assert message.role == "assistant" and message.type == "message"
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == want.choices[0].message.content
    assert message.usage.input_tokens == want.usage.prompt_tokens
    assert message.usage.output_tokens == want.usage.completion_tokens
    reason = {"length": "max_tokens", "stop": "end_turn"}[want.choices[0].finish_reason]
    assert message.stop_reason == reason
    count = client.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Hi"}]
    )
    assert count.input_tokens == message.usage.input_tokens


def test_streamed_events_add_up_to_the_message(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=10, extra_body={"temperature": 0})
    whole = client.messages.create(**kwargs)
    with client.messages.stream(**kwargs) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[1] == "content_block_start" and "content_block_delta" in kinds
    assert kinds[-3:-1] == ["content_block_stop", "message_delta"]
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10


def test_thinking_text_and_tool_use_then_its_result(client):
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=160,  # greedy: the regex's text in the same tokens every time
        extra_body={"guided_regex": THINK_AND_CALL, "temperature": 0},
    )
    message = client.messages.create(**kwargs)
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    thinking, text, call = message.content
    assert thinking.thinking == "I need the weather." and text.text == "Let me check."
    assert call.name == "get_weather" and call.input == {"city": "Oslo"}
    assert call.id.startswith("toolu_") and message.stop_reason == "tool_use"

    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    json_deltas = [
        e for e in events if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert len(json_deltas) > 2  # the input streamed, not whole
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[2].input == {"city": "Oslo"} and final.stop_reason == "tool_use"

    follow_up = client.messages.create(
        model=MODEL,
        messages=[
            *ASK,
            {"role": "assistant", "content": [b.model_dump() for b in message.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}],
            },
        ],
        tools=[WEATHER],
        max_tokens=4,
        extra_body={"temperature": 0},
    )
    assert follow_up.usage.input_tokens > message.usage.input_tokens
    assert follow_up.stop_reason in ("max_tokens", "end_turn")


def test_stop_sequences_and_tool_choice_any(client):
    message = client.messages.create(
        model=MODEL,
        messages=ASK,
        max_tokens=20,
        stop_sequences=["b"],
        extra_body={"guided_regex": "aaab[a-z]+"},
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == "b"
    assert message.content[0].text == "aaa"
    forced = client.messages.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        max_tokens=100,
        extra_body={"seed": 0, "temperature": 1.0},
    )
    [call] = [b for b in forced.content if b.type == "tool_use"]
    assert call.name == "get_weather" and isinstance(call.input.get("city"), str)


def test_errors_have_anthropics_shape_and_auth_takes_x_api_key(server, client):
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=MODEL, messages=[], max_tokens=5)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", messages=ASK, max_tokens=5)
    wrong = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        wrong.messages.create(model=MODEL, messages=ASK, max_tokens=5)
    assert info.value.body["error"]["type"] == "authentication_error"
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = {"model": MODEL, "messages": ASK, "max_tokens": 2}
        assert http.post("/v1/messages", json=body, headers={"x-api-key": KEY}).status_code == 200
        bearer = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/v1/messages", json=body, headers=bearer).status_code == 200
        # The OpenAI routes keep OpenAI's error shape.
        reply = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
        assert reply.status_code == 401 and "type" in reply.json()["error"]
        assert "code" in reply.json()["error"]
        image = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": ""},
        }
        bad = {**body, "messages": [{"role": "user", "content": [image]}]}
        reply = http.post("/v1/messages", json=bad, headers={"x-api-key": KEY})
        assert reply.status_code == 400
        assert reply.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": reply.json()["error"]["message"]},
        }
        assert "'image'" in reply.json()["error"]["message"]
