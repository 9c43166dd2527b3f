"""Structured output and tool calls through the server, with the real openai SDK, on a tiny
random model with a tiny BPE tokenizer and a Hermes-style chat template
(tests/tiny_tokenizer.py); the parsers and the streaming hold-back on their own."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from kiln.server.reply import ReplyStream
from kiln.server.tool_calls import ToolPlan, get_parser, plan_tools
from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread, offline

openai = lazy_import("openai")

MODEL = "tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
            "required": ["zone"],
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]
HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


class Address(BaseModel):
    zip: Annotated[str, Field(pattern=r"^[0-9]{5}$")]
    ok: bool


class Person(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    age: Annotated[int, Field(ge=0, le=150)]
    color: Literal["red", "green", "blue"]
    tags: Annotated[list[Annotated[str, Field(pattern=r"^[a-z]{1,6}$")]], Field(max_length=3)]
    address: Address


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory):
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path_factory.mktemp("tiny-tools")))
    config = EngineConfig(model=path, max_model_len=512, kv_cache_memory_gb=0.05, max_num_seqs=16)
    return AsyncEngine(LLMEngine(config))


@pytest.fixture(scope="module")
def server(async_engine):
    from kiln.server.app import build_app

    with ServerThread(build_app(async_engine, MODEL)) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="-", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


# ---- structured output on the server ------------------------------------------------------


def test_sdk_parse_with_a_pydantic_model(client):
    for seed in range(3):
        completion = client.beta.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": "A person, please."}],
            response_format=Person,
            temperature=1.0,
            seed=seed,
            max_tokens=200,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)
        jsonschema.validate(json.loads(choice.message.content), Person.model_json_schema())


def test_streamed_json_schema_and_json_object(client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    stream = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
        temperature=0.7,
        seed=1,
        max_tokens=60,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(text), schema)
    reply = client.chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, max_tokens=150
    )
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:
        assert reply.choices[0].finish_reason == "length"


def test_completions_take_response_format_and_the_guided_extras(client):
    schema = Person.model_json_schema()
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}, None),
        ({"guided_json": schema}, None),
        ({"guided_regex": r"[a-c]{2}-[0-9]{3}"}, r"[a-c]{2}-[0-9]{3}"),
        ({"guided_choice": ["yes", "no"]}, r"yes|no"),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]?'}, r"x[0-9][0-9]?"),
    ]
    for extra, pattern in cases:
        reply = client.completions.create(
            model=MODEL, prompt="Q:", max_tokens=200, seed=5, temperature=1.0, extra_body=extra
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (extra, choice.text)
        if pattern is None:
            jsonschema.validate(json.loads(choice.text), schema)
        else:
            assert re.fullmatch(pattern, choice.text), (extra, choice.text)


@pytest.mark.parametrize(
    "path, body, param, words",
    [
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}},
            "response_format",
            "JSON schema",
        ),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format", "xml"),
        (
            "/v1/chat/completions",
            {"response_format": {"type": "json_schema"}},
            "response_format.json_schema",
            "json_schema",
        ),
        ("/v1/completions", {"guided_regex": "a(b"}, "guided_regex", "regex"),
        ("/v1/completions", {"guided_grammar": "root ::= nope"}, "guided_grammar", "EBNF"),
        ("/v1/completions", {"guided_json": "{not json"}, "guided_json", "not valid JSON"),
        ("/v1/completions", {"guided_choice": []}, "guided_choice", "non-empty"),
        (
            "/v1/completions",
            {"guided_regex": "a", "guided_choice": ["b"]},
            "guided_choice",
            "not several",
        ),
        ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools", "tools[0]"),
        (
            "/v1/chat/completions",
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among the tools",
        ),
        ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            "/v1/completions",
            {"use_beam_search": True, "stop": ["x"]},
            "use_beam_search",
            "does not combine",
        ),
        ("/v1/completions", {"use_beam_search": True, "n": 3, "best_of": 2}, "best_of", ">= n"),
    ],
)
def test_bad_specs_are_400_naming_the_problem(http, path, body, param, words):
    key = "messages" if "chat" in path else "prompt"
    reply = http.post(path, json={key: ASK if key == "messages" else "Q:", **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_compile_failing_after_validation_is_an_error_for_that_request(http, monkeypatch):
    """The compile runs after the request is accepted: its failure still reaches the client as
    an error (a 400 naming it), and a plain request beside it is served."""
    from kiln.errors import InvalidRequestError
    from kiln.structured_output.compiler import GrammarCompilerCache

    def fail(self, kind, text):
        raise InvalidRequestError("invalid regex: the compiler gave up", param="guided_regex")

    monkeypatch.setattr(GrammarCompilerCache, "_compile", fail)
    body = {"prompt": "Q:", "max_tokens": 4, "guided_regex": "y+late-failure"}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    assert "the compiler gave up" in reply.json()["error"]["message"]
    streamed = http.post("/v1/completions", json={**body, "stream": True})
    assert streamed.status_code == 200  # the stream began before the compile failed
    assert "the compiler gave up" in streamed.text and '"invalid_request_error"' in streamed.text
    assert streamed.text.endswith("data: [DONE]\n\n")
    plain = http.post("/v1/completions", json={"prompt": "Q:", "max_tokens": 4})
    assert plain.status_code == 200 and plain.json()["choices"][0]["finish_reason"] == "length"


def test_beam_search_extras_equal_the_offline_api(client, async_engine):
    from kiln import SamplingParams

    reply = client.completions.create(
        model=MODEL,
        prompt="Once upon",
        n=2,
        best_of=4,
        max_tokens=8,
        extra_body={"use_beam_search": True, "length_penalty": 0.5},
    )
    params = SamplingParams(use_beam_search=True, best_of=4, n=2, max_tokens=8, length_penalty=0.5)
    want = offline(async_engine, lambda llm: llm.generate(["Once upon"], params))[0]
    assert [c.text for c in reply.choices] == [c.text for c in want.outputs]
    assert reply.usage.completion_tokens == sum(len(c.token_ids) for c in want.outputs)


# ---- tool calls -----------------------------------------------------------------------------


def _check_call(call) -> dict:
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, PARAMS[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


def test_named_tool_choice_is_a_valid_call(client):
    reply = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        temperature=1.0,
        seed=2,
        max_tokens=60,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time"
    _check_call(call)


def test_required_tool_choice_parallel_or_not(client):
    for parallel in (True, False):
        for seed in range(3):
            reply = client.chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=parallel,
                temperature=1.0,
                seed=seed,
                max_tokens=120,  # the 512-token context holds the 390-token prompt and 122 more
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message
            calls = choice.message.tool_calls
            assert len(calls) >= 1 and (parallel or len(calls) == 1)
            for call in calls:
                _check_call(call)


@pytest.mark.parametrize("max_tokens", [120, 9])
@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_required_and_named_stream_their_arguments_as_written(client, tool_choice, max_tokens):
    """The call's arguments arrive in many deltas as the model writes them, and add up to the
    non-streamed reply's call; cut short by max_tokens, the call is closed, streamed or not."""
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        parallel_tool_calls=False,
        temperature=1.0,
        seed=3,
        max_tokens=max_tokens,
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finish == [whole.finish_reason]
    if not whole.message.tool_calls:  # required, cut before the name: the text, as written
        assert tool_choice == "required" and max_tokens < 20 and not deltas
        assert content == whole.message.content and whole.finish_reason == "length"
        return
    [call] = whole.message.tool_calls
    assert whole.finish_reason == ("tool_calls" if max_tokens > 20 else "length")
    assert [(d.index, d.function.name) for d in deltas if d.function.name] == [
        (0, call.function.name)
    ]
    assert deltas[0].id == chunks_id(deltas) and content == ""
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == call.function.arguments
    assert isinstance(json.loads(arguments), dict)  # closed when cut short
    if max_tokens > 20:
        _check_call(call)
        assert sum(bool(d.function.arguments) for d in deltas) > 3  # streamed, not whole
        assert len(chunks) > len(deltas)  # a chunk per token


def test_auto_parses_the_models_own_format_streamed_and_not(client):
    # A random model never writes a call by itself: a regex makes it write one, in the Hermes
    # format of its template, after some content; "auto" must find it in the text.
    regex = "Let me check\\. " + re.sub(r"([{}().\[\]])", r"\\\1", HERMES_CALL)
    kwargs = dict(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=80,
        extra_body={"guided_regex": regex},
    )
    reply = client.chat.completions.create(**kwargs)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert content.strip() == "Let me check." and "<tool_call>" not in content
    assert [(d.index, d.function.name) for d in deltas if d.function.name] == [(0, "get_weather")]
    assert deltas[0].id == chunks_id(deltas) and len(deltas) > 2  # the arguments streamed
    assert json.loads("".join(d.function.arguments for d in deltas)) == {"city": "Oslo"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # Without a call in the text, auto is plain content.
    plain = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], max_tokens=8, extra_body={"guided_regex": "hi+"}
    )
    assert plain.choices[0].message.tool_calls is None
    assert re.fullmatch("hi+", plain.choices[0].message.content)


def test_tools_reach_the_template_unless_tool_choice_none(client):
    def prompt_tokens(**kwargs) -> int:
        reply = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1, **kwargs)
        return reply.usage.prompt_tokens

    bare = prompt_tokens()
    assert prompt_tokens(tools=[WEATHER]) > bare + 20  # the tool's JSON in the system turn
    assert prompt_tokens(tools=[WEATHER], tool_choice="none") == bare


def test_two_turn_round_trip_with_a_tool_result(client, http):
    first = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        seed=0,
        max_tokens=150,
    )
    assert first.choices[0].finish_reason == "tool_calls", first.choices[0]
    message = first.choices[0].message
    [call] = message.tool_calls
    arguments = _check_call(call)
    conversation = [
        *ASK,
        message.model_dump(exclude_none=True),  # the assistant's turn, as the SDK returned it
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=conversation, tools=[WEATHER], max_tokens=8, temperature=0
    )
    assert second.choices[0].finish_reason in ("stop", "length")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The template rendered both the call (arguments as JSON) and the tool's result.
    ids = http.post("/tokenize", json={"messages": conversation}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    rendered = re.search(r"<tool_call>\n(.*)\n</tool_call>", text).group(1)
    assert json.loads(rendered) == {"name": "get_weather", "arguments": arguments}


def chunks_id(deltas) -> str:
    """The call's id: on its first delta only, as OpenAI streams it."""
    ids = [d.id for d in deltas if d.id]
    assert len(ids) == 1 and ids[0].startswith("call_")
    return ids[0]


# ---- parsers and the stream, on their own --------------------------------------------------


def test_hermes_parser():
    parser = get_parser("hermes")
    text = f"Sure.\n{HERMES_CALL}\n<tool_call>\n" + '{"name": "b", "arguments": {}}\n</tool_call>'
    content, calls = parser.parse(text)
    assert content == "Sure." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("b", {}),
    ]
    assert parser.parse("no call here") == ("no call here", [])
    assert parser.parse("<tool_call>{broken") == ("<tool_call>{broken", [])


def test_llama3_json_parser():
    parser = get_parser("llama3_json")
    content, calls = parser.parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {}),
    ]
    assert parser.parse('{"not": "a call"}')[1] == []
    assert parser.parse("Plain words.") == ("Plain words.", [])


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_stream_holds_back_calls_char_by_char(parser_name):
    plan = plan_tools([WEATHER], "auto", True, get_parser(parser_name))
    assert isinstance(plan, ToolPlan)
    if parser_name == "hermes":
        text, want_content = (
            f"Checking <tool{'_'}x> first. {HERMES_CALL}",
            "Checking <tool_x> first.",
        )
    else:
        text, want_content = '{"name": "get_weather", "parameters": {"city": "Oslo"}}', ""
    stream = ReplyStream(None, False, plan)
    events = [e for ch in text for e in stream.feed(ch)] + stream.finish()
    assert "".join(v for k, v in events if k == "content") == want_content
    assert [v for k, v in events if k == "call"] == ["get_weather"]
    arguments = "".join(v for k, v in events if k == "args")
    assert json.loads(arguments) == {"city": "Oslo"}
    assert sum(k == "args" for k, _ in events) > 3  # the arguments streamed, not whole
    plain = ReplyStream(None, False, plan)
    words = "Just words, {no call}."
    events = [e for ch in words for e in plain.feed(ch)] + plain.finish()
    assert "".join(v for _, v in events) == words


def test_auto_tools_on_a_template_that_cannot_show_them_is_a_400(tmp_path):
    """The tools would be dropped by the template and never seen: a 400 naming the template,
    not a reply that silently ignored them; required / named still constrain a call."""
    from kiln.config import EngineConfig
    from kiln.engine.async_engine import AsyncEngine
    from kiln.engine.llm_engine import LLMEngine
    from kiln.server.app import build_app
    from tests.tiny_tokenizer import build_tiny_chat_model

    path = build_tiny_chat_model(str(tmp_path / "plain"))
    config_file = tmp_path / "plain" / "tokenizer_config.json"
    tok_config = json.loads(config_file.read_text())
    tok_config["chat_template"] = (
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
    )
    config_file.write_text(json.dumps(tok_config))
    (tmp_path / "plain" / "chat_template.jinja").unlink(missing_ok=True)
    config = EngineConfig(model=path, max_model_len=256, kv_cache_memory_gb=0.02, max_num_seqs=4)
    engine = AsyncEngine(LLMEngine(config))
    with (
        ServerThread(build_app(engine, "plain-model")) as srv,
        httpx.Client(base_url=srv.base_url, timeout=120) as http,
    ):
        body = {"model": "plain-model", "messages": ASK, "max_tokens": 2, "tools": [WEATHER]}
        for auto in ({}, {"tool_choice": "auto"}):
            reply = http.post("/v1/chat/completions", json={**body, **auto})
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "tools" and "chat template of plain-model" in error["message"]
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named, "none"):
            reply = http.post("/v1/chat/completions", json={**body, "tool_choice": choice})
            assert reply.status_code == 200, reply.text
