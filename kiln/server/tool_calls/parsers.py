"""Parsers of the tool-call formats models are trained on: each says where a call starts, how its
header (the function's name) reads and what may follow a call; `CallScanner` (scanner.py) runs
them over text fed piece by piece, so arguments stream as the model writes them. `parse` is the
same scanner fed the whole text at once: streaming and not give the same calls by construction,
and the conformance suite (tests/server/test_parser_conformance.py) checks it at every cut."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal

Header = tuple[Literal["match", "partial", "no"], str, int, str]
"""(status, the function's name, where its arguments' value starts in the text, the mode of
what follows the call: "bare" when no object wraps the arguments)."""
After = tuple[Literal["partial", "header", "text"], int, str]
"""(status, characters consumed, the header mode that follows)."""

_WS = " \t\r\n"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        call: dict[str, object] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return call if index is None else {"index": index, **call}


class ToolCallParser:
    """One tool-call format. A call is opened once its name and the first character of its
    arguments (`{`, or `"` for arguments written as a JSON string) are read; from there on it
    is a call, and arguments cut short are closed so they parse."""

    name: str = ""
    markers: tuple[str, ...] = ()
    """Text that starts a tool call anywhere in the reply."""
    at_start_only: bool = False
    """A call counts only at the start of the reply (Llama 3.1's bare JSON)."""
    needs_special_tokens: bool = False
    """The marker is a special token the detokenizer must keep (Mistral's [TOOL_CALLS])."""
    end_text: str | None = None
    """With special tokens kept: the end-of-sequence token's text, which ends the reply and is
    no content (the server sets it from the tokenizer)."""
    first_mode: str = "object"

    def header(self, text: str, mode: str) -> Header:
        return object_header(text, ("arguments", "parameters"))

    def after(self, text: str, mode: str, final: bool) -> After:
        """What follows a call's object: its end marker, a separator to the next call, text."""
        return "text", 0, ""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the reply's text outside calls, or None; the calls found)."""
        from kiln.server.tool_calls.scanner import CallScanner

        scanner = CallScanner(self)
        events = scanner.feed(text) + scanner.finish()
        return collect(events)


def collect(events: list[tuple[str, str]]) -> tuple[str | None, list[ToolCall]]:
    """Scanner events -> (content or None, calls)."""
    content, names, arguments = "", [], []
    for kind, value in events:
        if kind == "content":
            content += value
        elif kind == "call":
            names.append(value)
            arguments.append("")
        else:
            arguments[-1] += value
    return content or None, [ToolCall(n, a) for n, a in zip(names, arguments)]


class _Cursor:
    """Steps through a header's fixed parts; any step may find the text ended (partial) or
    something else (no)."""

    def __init__(self, text: str, pos: int = 0) -> None:
        self.text, self.pos = text, pos
        self.status: Literal["match", "partial", "no"] = "match"

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _WS:
            self.pos += 1

    def literal(self, *options: str) -> str | None:
        if self.status != "match":
            return None
        rest = self.text[self.pos :]
        for option in options:
            if rest.startswith(option):
                self.pos += len(option)
                return option
        self.status = "partial" if any(o.startswith(rest) for o in options) else "no"
        return None

    def string(self) -> str | None:
        if self.literal('"') is None:
            return None
        i = self.pos
        while i < len(self.text):
            if self.text[i] == "\\":
                i += 2
                continue
            if self.text[i] == '"':
                try:
                    value = json.loads(self.text[self.pos - 1 : i + 1])
                except ValueError:
                    self.status = "no"
                    return None
                self.pos = i + 1
                return value
            i += 1
        self.status = "partial"
        return None

    def value_start(self) -> None:
        """The arguments' first character: an object, or a JSON string holding one."""
        self.ws()
        if self.status != "match":
            return
        if self.pos >= len(self.text):
            self.status = "partial"
        elif self.text[self.pos] not in '{"':
            self.status = "no"


def object_header(text: str, keys: tuple[str, ...], pos: int = 0) -> Header:
    """`{"name": "...", "<key>": ` then the arguments' first character."""
    cur = _Cursor(text, pos)
    cur.ws()
    cur.literal("{")
    cur.ws()
    cur.literal('"name"')
    cur.ws()
    cur.literal(":")
    cur.ws()
    name = cur.string()
    cur.ws()
    cur.literal(",")
    cur.ws()
    cur.literal(*(f'"{k}"' for k in keys))
    cur.ws()
    cur.literal(":")
    cur.value_start()
    if cur.status != "match" or name is None:
        return (cur.status if cur.status != "match" else "partial"), "", 0, ""
    return "match", name, cur.pos, "object"


def _after_marker(text: str, end_marker: str, final: bool) -> After:
    """Whitespace, then `end_marker` if it is there; what else follows is text."""
    i = len(text) - len(text.lstrip(_WS))
    rest = text[i:]
    if rest.startswith(end_marker):
        return "text", i + len(end_marker), ""
    if not final and end_marker.startswith(rest):
        return "partial", 0, ""
    return "text", i, ""


class HermesParser(ToolCallParser):
    """Qwen2.5 / Qwen3 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
    one block per call; text outside the blocks is the message's content."""

    name = "hermes"
    markers = ("<tool_call>",)

    def after(self, text: str, mode: str, final: bool) -> After:
        return _after_marker(text, "</tool_call>", final)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1 / 3.2 JSON tool calling: the reply is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`), several separated by `;`."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def header(self, text: str, mode: str) -> Header:
        cur = _Cursor(text)
        cur.ws()
        if mode == "object" and text[cur.pos :].startswith("<"):
            cur.literal("<|python_tag|>")
            if cur.status != "match":
                return cur.status, "", 0, ""
        return object_header(text, ("parameters", "arguments"), cur.pos)

    def after(self, text: str, mode: str, final: bool) -> After:
        i = len(text) - len(text.lstrip(_WS + ";"))
        if i == len(text) and not final:
            return "partial", 0, ""
        if text[i:].startswith("{"):
            return "header", i, "next"
        return "text", i, ""


class MistralParser(ToolCallParser):
    """Mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers), or
    `[TOOL_CALLS]name[ARGS]{...}` per call (v11 and later). `[TOOL_CALLS]` is a special token:
    the reply is detokenized with special tokens kept."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    needs_special_tokens = True
    first_mode = "marker"

    def header(self, text: str, mode: str) -> Header:
        keys = ("arguments", "parameters")
        if mode == "item":
            return object_header(text, keys)
        cur = _Cursor(text)
        cur.ws()
        if cur.pos >= len(text):
            return "partial", "", 0, ""
        if text[cur.pos] == "[":
            return object_header(text, keys, cur.pos + 1)
        start = cur.pos
        while cur.pos < len(text) and (text[cur.pos].isalnum() or text[cur.pos] in "_-."):
            cur.pos += 1
        name = text[start : cur.pos]
        if not name or (cur.pos == len(text) and "[ARGS]".startswith(text[cur.pos :])):
            return ("no" if not name else "partial"), "", 0, ""
        cur.literal("[ARGS]")
        cur.value_start()
        if cur.status != "match":
            return cur.status, "", 0, ""
        return "match", name, cur.pos, "bare"  # v11: no object around the arguments

    def after(self, text: str, mode: str, final: bool) -> After:
        if mode == "bare":
            return "text", 0, ""
        i = len(text) - len(text.lstrip(_WS))
        if i == len(text) and not final:
            return "partial", 0, ""
        if text[i:].startswith(","):
            return "header", i + 1, "item"
        if text[i:].startswith("]"):
            return "text", i + 1, ""
        return "text", i, ""


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "qwen3": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: choose from {sorted(PARSERS)}")
    return PARSERS[name]()


def detect_parser(chat_template: str | None) -> ToolCallParser:
    """The parser a chat template's own tool format calls for (Hermes when it says nothing)."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return HermesParser()
    if "[TOOL_CALLS]" in template:
        return MistralParser()
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonParser()
    return HermesParser()
