"""OpenAI's Responses API through the official openai SDK, streamed and not, on the tiny random
chat model (tests/tiny_tokenizer.py) served with the qwen3 reasoning parser. A random model
writes no `<think>` block or tool call by itself: a regex (vLLM's guided_regex extra) makes it
write them, and the parsers must find them."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from kiln.server.protocol import ChatMessage
from kiln.server.responses.store import ResponseStore, StoredResponse
from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread, tiny_chat_engine

openai = lazy_import("openai")

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
THINK_AND_CALL = "<think>\nI need the weather\\.\n</think>\n\n" + re.sub(
    r"([{}().\[\]])", r"\\\1", CALL
)


@pytest.fixture(scope="module")
def server():
    from kiln.server.app import build_app

    app = build_app(tiny_chat_engine(), MODEL, reasoning_parser="qwen3", responses_store_size=4)
    with ServerThread(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=120)


def test_text_reply_equals_chat_completions(client):
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        max_tokens=12,
        temperature=0,
    )
    response = client.responses.create(
        model=MODEL, instructions="Be brief.", input="Hi", max_output_tokens=12, temperature=0
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    if chat.choices[0].finish_reason == "length":
        assert response.status == "incomplete"
        assert response.incomplete_details.reason == "max_output_tokens"
    else:
        assert response.status == "completed"
    assert client.responses.retrieve(response.id).output_text == response.output_text


def test_streamed_events_in_openai_order_add_up_to_the_response(client):
    stream = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=10, temperature=0, stream=True
    )
    events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:5] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",  # 10 tokens of a random model: cut short
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text == events[-4].text
    whole = client.responses.create(model=MODEL, input="Hi", max_output_tokens=10, temperature=0)
    assert whole.output_text == text
    assert client.responses.retrieve(final.id).output_text == text
    # The SDK's stream helper accumulates the events into the response (it needs a reply that
    # completes: an incomplete one ends with response.incomplete, which it does not take).
    with client.responses.stream(
        model=MODEL, input="Hi", max_output_tokens=10, extra_body={"guided_regex": "Hello there"}
    ) as helper:
        texts = [e.delta for e in helper if e.type == "response.output_text.delta"]
        accumulated = helper.get_final_response()
    assert "".join(texts) == accumulated.output_text == "Hello there"
    assert accumulated.status == "completed"


def test_reasoning_and_a_function_call_then_its_output(client):
    kwargs = dict(
        model=MODEL,
        input=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER],
        max_output_tokens=160,  # greedy: the regex's text in the same tokens every time
        temperature=0,
        extra_body={"guided_regex": THINK_AND_CALL},
    )
    first = client.responses.create(**kwargs)
    assert [i.type for i in first.output] == ["reasoning", "function_call"]
    assert first.output[0].content[0].text == "I need the weather."
    assert 0 < first.usage.output_tokens_details.reasoning_tokens < first.usage.output_tokens
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.call_id.startswith("call_")

    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert "response.reasoning_text.delta" in kinds
    assert kinds.count("response.function_call_arguments.delta") > 2  # streamed, not whole
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(e.arguments) for e in done] == [{"city": "Oslo"}]
    streamed = events[-1].response
    assert events[-1].type == "response.completed"
    assert [i.type for i in streamed.output] == ["reasoning", "function_call"]
    assert streamed.output[0].content[0].text == "I need the weather."
    with client.responses.stream(**kwargs) as helper:
        accumulated = helper.get_final_response()
    assert json.loads(accumulated.output[1].arguments) == {"city": "Oslo"}

    # The next turn sends the call's output only: the server holds the conversation, and the
    # first turn's prompt is the prefix of this one's (the prefix cache serves it).
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER],
        max_output_tokens=5,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens - 16, (cached, first.usage.input_tokens)


def test_a_tool_schema_with_an_integer_beyond_64_bits_streams_and_stores(client):
    huge = 2**70  # JSON allows it; orjson refuses to write it
    tool = {**WEATHER, "parameters": {**WEATHER["parameters"], "maxProperties": huge}}
    stream = client.responses.create(
        model=MODEL, input="Hi", tools=[tool], max_output_tokens=4, temperature=0, stream=True
    )
    events = list(stream)
    assert events[0].type == "response.created"
    assert events[0].response.tools[0].parameters["maxProperties"] == huge
    final = events[-1].response
    assert client.responses.retrieve(final.id).tools[0].parameters["maxProperties"] == huge


def test_named_tool_choice_is_a_valid_call(client):
    time_tool = {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    }
    response = client.responses.create(
        model=MODEL,
        input="Time?",
        tools=[WEATHER, time_tool],
        tool_choice={"type": "function", "name": "get_time"},
        temperature=1.0,
        max_output_tokens=60,
        extra_body={"seed": 3},
    )
    [call] = [i for i in response.output if i.type == "function_call"]
    assert call.name == "get_time"
    jsonschema.validate(json.loads(call.arguments), time_tool["parameters"])


def test_store_false_delete_and_unknown_ids(client):
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as info:
        client.responses.create(
            model=MODEL, input="Hi", max_output_tokens=2, previous_response_id=unstored.id
        )
    assert info.value.body["param"] == "previous_response_id"
    stored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2)
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(stored.id)


def test_bad_requests_are_400_naming_the_field(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        cases = [
            ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
            ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
            ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
            ({"input": "x", "n": 2}, "n"),
            ({"input": []}, "input"),
        ]
        for body, param in cases:
            reply = http.post("/v1/responses", json=body)
            assert reply.status_code == 400, (body, reply.text)
            assert reply.json()["error"]["param"] == param, reply.text


def test_the_store_is_bounded_least_recently_used_first():
    store = ResponseStore(2)
    for name in ("a", "b"):
        store.put(StoredResponse({"id": name}, []))
    assert store.get("a") is not None  # a is now the most recently used
    store.put(StoredResponse({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and len(store) == 2


def test_stores_on_one_file_share_entries_order_and_bound(tmp_path):
    """What `--api-server-count N` relies on: each API process opens the same file; a put in
    one is a get in another, a get anywhere makes an entry recent, a delete is gone for all."""
    path = str(tmp_path / "responses.sqlite")
    first, second = ResponseStore(2, path), ResponseStore(2, path)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    conversation = [
        ChatMessage(role="user", content="Hi"),
        ChatMessage(role="assistant", content=None, tool_calls=[call]),
        ChatMessage(role="tool", content="42", tool_call_id="c1"),
    ]
    first.put(StoredResponse({"id": "a", "output": [{"type": "message"}]}, conversation))
    got = second.get("a")
    assert got is not None and got.response == {"id": "a", "output": [{"type": "message"}]}
    assert got.conversation == conversation
    second.put(StoredResponse({"id": "b"}, []))
    assert first.get("a") is not None  # a is now the most recently used, for both
    second.put(StoredResponse({"id": "c"}, []))
    assert first.get("b") is None and len(first) == len(second) == 2
    assert second.delete("a") and first.get("a") is None and not first.delete("a")
    assert first.get("c") is not None
    wide = {"id": "w", "tools": [{"parameters": {"maximum": 2**70}}]}  # JSON allows it
    first.put(StoredResponse(wide, []))
    assert second.get("w").response == wide
