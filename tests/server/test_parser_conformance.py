"""Conformance of every reasoning and tool-call parser: recorded model outputs (the formats as
the models write them, including replies cut short and garbled), fed whole and cut at every
character boundary, one character at a time and in random pieces. Streamed events must add up to
the whole-reply parse, that must equal the recorded answer, and every call's arguments parse."""

from __future__ import annotations

import json
import random

import pytest

from kiln.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from kiln.server.reply import ReplyStream, whole_reply
from kiln.server.tool_calls import PARSERS, CallScanner, get_parser, plan_tools
from kiln.server.tool_calls.json_prefix import JsonPrefix

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ARGS = '{"city": "Oslo", "days": [1, 2.5e3, -0.25], "q": "a \\"b\\" \\u00e9 {x}", "ok": true}'

# (parser, reply, content, [(name, arguments as an object or None if cut)]): None arguments
# mean the call was closed by the server; the test checks they parse.
TOOL_CASES = [
    (
        "hermes",
        "Plain words, {braces} and <tool_ not a call.",
        "Plain words, {braces} and <tool_ not a call.",
        [],
    ),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>',
        None,
        [("get_weather", json.loads(ARGS))],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>\nDone.',
        "Let me check.\n\n\nDone.",
        [("a", {"x": 1}), ("b", {})],
    ),
    (
        "hermes",
        '<tool_call>{"name": "s", "arguments": "{\\"k\\": 2}"}</tool_call>',
        None,
        [("s", {"k": 2})],
    ),
    ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": "Os', None, [("x", None)]),
    ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": [1, 2', None, [("x", None)]),
    ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": tru', None, [("x", None)]),
    ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": 1} oops', "oops", [("x", {"a": 1})]),
    ("hermes", '<tool_call>\n{"name": "x", "arguments": {"a": 1 ] tail', "] tail", [("x", None)]),
    ("hermes", "<tool_call>{broken", "<tool_call>{broken", []),
    (
        "hermes",
        '<tool_call>{"name": "x", "arguments": 5}</tool_call>',
        '<tool_call>{"name": "x", "arguments": 5}</tool_call>',
        [],
    ),
    ("hermes", '<tool_call>{"name": "x", "arguments": {}, "id": 7}</tool_call>', None, [("x", {})]),
    (
        "llama3_json",
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        None,
        [("a", {"x": 1}), ("b", {})],
    ),
    ("llama3_json", f'  {{"name": "w", "parameters": {ARGS}}}', None, [("w", json.loads(ARGS))]),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("llama3_json", "Plain words {x}.", "Plain words {x}.", []),
    ("llama3_json", '{"name": "a", "parameters": {"x": [', None, [("a", None)]),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, '
        '{"name": "b", "arguments": {"y": "z"}}]',
        "Sure.",
        [("a", {"x": 1}), ("b", {"y": "z"})],
    ),
    (
        "mistral",
        f"[TOOL_CALLS]get_weather[ARGS]{ARGS}[TOOL_CALLS]b[ARGS]{{}}",
        None,
        [("get_weather", json.loads(ARGS)), ("b", {})],
    ),
    ("mistral", '[TOOL_CALLS]a[ARGS]{"x": "cut', None, [("a", None)]),
    ("mistral", "[TOOL_CALLS] nothing here", "[TOOL_CALLS] nothing here", []),
]

# tool_choice "required" / named (tool_choice "w"): (choice, reply, content, calls as above);
# the grammar writes these, cut short by max_tokens anywhere.
GUIDED_TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
    for n in ("w", "t")
]
GUIDED_CASES = [
    (
        "required",
        f'[{{"name":"w","parameters":{ARGS}}},{{"name":"t","parameters":{{}}}}]',
        None,
        [("w", json.loads(ARGS)), ("t", {})],
    ),
    (
        "required",
        f'[ {{ "name" : "t" , "parameters" : {ARGS} }} ]',
        None,
        [("t", json.loads(ARGS))],
    ),
    ("required", '[{"parameters":{"q":1},"name":"t"}]', None, [("t", {"q": 1})]),
    ("required", '[{"name":"w","parameters":{"a":[1,2', None, [("w", None)]),
    ("required", '[{"name":"w","parameters":{"a":"Os', None, [("w", None)]),
    ("required", '[{"name":"w","parameters":{}},{"name":"t","para', None, [("w", {}), ("t", {})]),
    ("required", '[{"name":"w",', None, [("w", {})]),
    ("required", '[{"na', '[{"na', []),
    ("named", ARGS, None, [("w", json.loads(ARGS))]),
    ("named", '{"city": "Oslo", "n": 12', None, [("w", None)]),
    ("named", '{"a": 1} after', None, [("w", {"a": 1})]),
    ("named", "", None, [("w", {})]),
    ("named", "{", None, [("w", {})]),
]

# (parser, reply, prompt left <think> open, reasoning, content)
REASONING_CASES = [
    (
        "qwen3",
        "<think>\nThe user wants X.\nSo Y.\n</think>\n\nThe answer is Y.",
        False,
        "The user wants X.\nSo Y.",
        "The answer is Y.",
    ),
    (
        "qwen3",
        "No thinking here: </think> is just text.",
        False,
        None,
        "No thinking here: </think> is just text.",
    ),
    (
        "qwen3",
        "Reasoning from an open prompt.</think>Answer.",
        True,
        "Reasoning from an open prompt.",
        "Answer.",
    ),
    ("qwen3", "<think>\ncut short in thought", False, "cut short in thought", None),
    ("qwen3", "<thin", False, None, "<thin"),
    ("qwen3", "<think></think>\n\nEmpty thought.", False, None, "Empty thought."),
    ("deepseek_r1", "Let me think.\n</think>\n\nAnswer: 4.", False, "Let me think.", "Answer: 4."),
    ("deepseek_r1", "<think>\nHmm </thin k.\n</think>Yes.", False, "Hmm </thin k.", "Yes."),
    ("deepseek_r1", "All reasoning, never closed", False, "All reasoning, never closed", None),
]


def _cuts(text: str, seed: int) -> list[list[str]]:
    """The ways a reply is fed: whole, one character at a time, every two-piece cut, and
    random pieces of one to seven characters."""
    ways = [[text], list(text)]
    ways += [[text[:i], text[i:]] for i in range(1, len(text))]
    rng = random.Random(seed)
    for _ in range(5):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i : i + n])
            i += n
        ways.append(pieces)
    return ways


def _streamed(parser_name: str, pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    scanner = CallScanner(get_parser(parser_name))
    events = [e for piece in pieces for e in scanner.feed(piece)] + scanner.finish()
    content, calls = "", []
    for kind, value in events:
        if kind == "content":
            content += value
        elif kind == "call":
            calls.append([value, ""])
        else:
            calls[-1][1] += value
    return content or None, [tuple(c) for c in calls]


def test_every_parser_has_cases():
    assert {c[0] for c in TOOL_CASES} == {p for p in PARSERS if p not in ("qwen25", "qwen3")}
    assert {c[0] for c in REASONING_CASES} == set(REASONING_PARSERS)


@pytest.mark.parametrize("case", range(len(TOOL_CASES)))
def test_tool_call_parsers_stream_as_they_parse(case):
    name, text, want_content, want_calls = TOOL_CASES[case]
    content, calls = get_parser(name).parse(text)
    assert content == want_content
    assert [c.name for c in calls] == [n for n, _ in want_calls]
    for call, (_, want) in zip(calls, want_calls):
        parsed = json.loads(call.arguments)  # never malformed, even when cut short
        assert isinstance(parsed, dict)
        if want is not None:
            assert parsed == want
    whole = (content, [(c.name, c.arguments) for c in calls])
    for pieces in _cuts(text, case):
        assert _streamed(name, pieces) == whole, pieces


@pytest.mark.parametrize("case", range(len(GUIDED_CASES)))
def test_required_and_named_calls_stream_as_they_parse(case):
    """The constrained replies of tool_choice "required" and a named function: arguments go out
    as they are written (more than one piece), closed when cut short, streaming equal to the
    whole-reply message (parameters written before the name wait for it)."""
    choice, text, want_content, want_calls = GUIDED_CASES[case]
    tool_choice = (
        choice if choice == "required" else {"type": "function", "function": {"name": "w"}}
    )
    plan = plan_tools(GUIDED_TOOLS, tool_choice, True, get_parser("hermes"))
    whole = whole_reply(text, None, False, plan)
    assert whole.content == want_content
    assert [c.name for c in whole.calls] == [n for n, _ in want_calls]
    for call, (_, want) in zip(whole.calls, want_calls):
        parsed = json.loads(call.arguments)  # never malformed, even when cut short
        assert isinstance(parsed, dict)
        if want is not None:
            assert parsed == want
    want_events = (whole.content, [(c.name, c.arguments) for c in whole.calls])
    for pieces in _cuts(text, case):
        stream = ReplyStream(None, False, plan)
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        content = "".join(v for k, v in events if k == "content") or None
        calls: list[list[str]] = []
        for kind, value in events:
            if kind == "call":
                calls.append([value, ""])
            elif kind == "args":
                calls[-1][1] += value
        assert (content, [tuple(c) for c in calls]) == want_events, pieces
        named_first = choice == "named" or text.find('"name"') < text.find('"parameters"')
        if len(pieces) == len(text) > 20 and calls and named_first:  # a character at a time
            assert sum(k == "args" for k, _ in events) > len(calls)  # not sent whole


@pytest.mark.parametrize("case", range(len(REASONING_CASES)))
def test_reasoning_parsers_stream_as_they_parse(case):
    name, text, prompt_open, want_reasoning, want_content = REASONING_CASES[case]
    parser = get_reasoning_parser(name)
    assert parser.parse(text, prompt_open) == (want_reasoning, want_content)
    for pieces in _cuts(text, case):
        scanner = parser.scanner(prompt_open)
        events = [e for piece in pieces for e in scanner.feed(piece)] + scanner.finish()
        got = {
            k: "".join(v for kind, v in events if kind == k) or None
            for k in ("reasoning", "content")
        }
        assert (got["reasoning"], got["content"]) == (want_reasoning, want_content), pieces


def test_reasoning_then_a_tool_call_streams_as_it_parses():
    text = (
        "<think>\nI need the weather.\n</think>\n\nChecking.<tool_call>\n"
        '{"name": "f", "arguments": {"c": "Oslo"}}\n</tool_call>'
    )
    plan = plan_tools([TOOL], "auto", True, get_parser("hermes"))
    reasoning = get_reasoning_parser("qwen3")
    whole = whole_reply(text, reasoning, False, plan)
    assert (whole.reasoning, whole.content) == ("I need the weather.", "Checking.")
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("f", {"c": "Oslo"})]
    for pieces in _cuts(text, 0):
        stream = ReplyStream(reasoning, False, plan)
        events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
        joined = {
            k: "".join(v for kind, v in events if kind == k)
            for k in ("reasoning", "content", "args")
        }
        assert joined == {
            "reasoning": "I need the weather.",
            "content": "Checking.",
            "args": whole.calls[0].arguments,
        }
        assert [v for k, v in events if k == "call"] == ["f"] and len(stream.ids) == 1


def test_prompt_that_opens_the_block():
    parser = get_reasoning_parser("qwen3")
    assert parser.opens("<|im_start|>assistant\n<think>\n")
    assert not parser.opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not parser.opens("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "text",
    ['{"a": [1, {"b": null}], "c": "x\\ny"}', "[]", '{"n": -0.5e-3}', '"str"', "12"],
)
def test_json_prefix_closes_every_prefix(text):
    for i in range(len(text) + 1):
        scan = JsonPrefix()
        scan.feed(text[:i])
        if scan.closable:
            json.loads(scan.closed())
    whole = JsonPrefix()
    whole.feed(text)
    whole.finish_number()
    assert whole.done and whole.text == text


@pytest.mark.parametrize("bad", ["{,", '{"a" 1}', "[1,]", "01", "1.e5", "-.5", '{"a": tx}'])
def test_json_prefix_finds_errors(bad):
    scan = JsonPrefix()
    scan.feed(bad)
    scan.finish_number()
    assert scan.error or not scan.done


def test_the_eos_text_of_a_reply_that_keeps_special_tokens_is_no_content():
    """Mistral's replies keep special tokens ([TOOL_CALLS] is one), so the detokenizer writes
    the EOS token's text at their end: it is held back and dropped, streamed or not."""
    parser = get_parser("mistral")
    parser.end_text = "</s>"
    plan = plan_tools([TOOL], "auto", True, parser)
    for text, content in [
        ('Sure.[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]</s>', "Sure."),
        ("Plain text with </ inside.</s>", "Plain text with </ inside."),
        ("No end token", "No end token"),
    ]:
        whole = whole_reply(text, None, False, plan)
        assert whole.content == content
        for pieces in _cuts(text, 1):
            stream = ReplyStream(None, False, plan)
            events = [e for piece in pieces for e in stream.feed(piece)] + stream.finish()
            assert "".join(v for k, v in events if k == "content") == content, pieces
            assert [v for k, v in events if k == "call"] == [c.name for c in whole.calls]
