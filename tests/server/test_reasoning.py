"""`--reasoning-parser` on chat completions through the openai SDK: `reasoning_content` on the
message and in stream deltas, the content and tool calls after the block, on the tiny random
chat model (a regex makes it write a `<think>` block; the parser must find it)."""

from __future__ import annotations

import json
import re

import pytest

from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread, tiny_chat_engine

openai = lazy_import("openai")

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


def _escape(text: str) -> str:
    return re.sub(r"([{}().\[\]])", r"\\\1", text)


@pytest.fixture(scope="module")
def client():
    from kiln.server.app import build_app

    app = build_app(tiny_chat_engine(), MODEL, reasoning_parser="deepseek_r1")
    with ServerThread(app) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="-", max_retries=0)


def test_reasoning_content_whole_and_streamed(client):
    # DeepSeek-R1 style: no opening tag, reasoning until </think>.
    regex = "Two and two\\. </think>\n\nIt is 4\\."
    kwargs = dict(
        model=MODEL, messages=ASK, max_tokens=100, temperature=0, extra_body={"guided_regex": regex}
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "Two and two."
    assert message.content == "It is 4."
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    assert (reasoning, content) == ("Two and two.", "It is 4.")
    # The reasoning streams before the content: no delta carries content before the last
    # reasoning delta.
    kinds = [
        "r" if getattr(d, "reasoning_content", None) else "c"
        for d in deltas
        if d.content or getattr(d, "reasoning_content", None)
    ]
    assert "".join(kinds) == "r" * kinds.count("r") + "c" * kinds.count("c")


def test_reasoning_then_a_tool_call(client):
    regex = "Need weather\\.</think>" + _escape(CALL)
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=160,  # greedy: the regex's text in the same tokens every time
        temperature=0,
        extra_body={"guided_regex": regex},
    )
    choice = client.chat.completions.create(**kwargs).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.reasoning_content == "Need weather."
    assert choice.message.content is None
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Oslo"}
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Oslo"}
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need weather."
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
