"""Parsers of the tool-call formats models are trained on, text in, (content, calls) out."""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field


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


class ToolCallParser(ABC):
    name: str
    markers: tuple[str, ...]
    """Text that starts a tool call: streaming holds back from the first one on."""
    at_start_only: bool = False
    """A marker counts only at the start of the reply (Llama 3.1's bare JSON)."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(the reply's text outside calls, or None; the calls found)."""


def _call(obj: object, arguments_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get(arguments_key, obj.get("arguments", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        return ToolCall(obj["name"], arguments)
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class HermesParser(ToolCallParser):
    """Qwen2.5 / Hermes: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
    block per call; text outside the blocks is the message's content."""

    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for match in self._block.finditer(text):
            try:
                call = _call(json.loads(match.group(1)), "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: leave the text as it is
            calls.append(call)
        content = self._block.sub("", text).strip()
        return content or None, calls


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1 / 3.2 JSON tool calling: the reply is `{"name": ..., "parameters": {...}}`
    (optionally after `<|python_tag|>`), several separated by `;`."""

    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start_only = True

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        decoder = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except ValueError:
                return text, []
            call = _call(obj, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            pos = end
            while pos < len(body) and body[pos] in " \t\r\n;":
                pos += 1
        return None, calls


PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "qwen25": HermesParser,
    "llama3_json": Llama3JsonParser,
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
    if "<|python_tag|>" in template or '"parameters"' in template:
        return Llama3JsonParser()
    return HermesParser()
