"""Runs a constrained reply (tool_choice "required" or a named function) piece by piece: the call
opens as soon as its name is known and its arguments go out as the model writes them, up to what
closers alone complete (json_prefix.py), as CallScanner does for `auto`. A call cut short
(max_tokens) is closed, so every emitted call's arguments parse. The whole-reply path feeds the
same scanner the whole text, so streaming equals non-streaming by construction.

named: the reply is the function's arguments. required: the reply is a JSON array of
{"name": ..., "parameters": {...}} objects; a reply cut short before any call's name is plain
content (its text, as it was written). Events are CallScanner's."""

from __future__ import annotations

import json

from kiln.server.tool_calls.json_prefix import JsonPrefix

Event = tuple[str, str]
_WS = " \t\r\n"


class GuidedCallScanner:
    def __init__(self, mode: str, function_name: str | None = None) -> None:
        assert mode in ("named", "required")
        assert mode == "required" or function_name is not None
        self.mode = mode
        self.function_name = function_name
        self.raw = ""  # every character fed: the reply's content if it never opens a call
        self.num_calls = 0
        # named starts in the arguments; required in front of the array
        self.state = "value" if mode == "named" else "open"
        self.key = "parameters" if mode == "named" else ""
        self.value: JsonPrefix | None = None  # the key or value being read
        self.call_open = False  # the current item's call was announced, arguments not closed
        self.sent = 0  # characters of the current arguments emitted
        self.name: str | None = None  # the current item's name, once read
        self.early_args: str | None = None  # parameters that came before the name
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        self._events = []
        if self.mode == "named" and not self.num_calls:
            self._open(self.function_name or "")
        self.raw += text
        for ch in text:
            self._step(ch)
        return self._events

    def finish(self) -> list[Event]:
        self._events = []
        if self.mode == "named" and not self.num_calls:
            self._open(self.function_name or "")
        value = self.value
        if value is not None and self.state == "value":
            value.finish_number()
            if value.done:
                self._value_done()
        self._close_args()
        if not self.num_calls and self.raw:
            self._events.append(("content", self.raw))
        self.state = "end"
        return self._events

    # ---- the characters

    def _step(self, ch: str) -> None:
        state = self.state
        if state in ("end", "dead"):
            return
        if state == "value":
            self._value_char(ch)
            return
        if state == "key_string":
            assert self.value is not None
            if not self.value.feed(ch):
                self._die()
            elif self.value.done:
                self.key = json.loads(self.value.text)
                self.value, self.state = None, "colon"
            return
        if ch in _WS:
            return
        if state == "open":
            self._expect(ch == "[", "item")
        elif state == "item":
            if ch == "{":
                self.name, self.early_args, self.state = None, None, "key"
            else:
                self._expect(ch == "]", "end")
        elif state == "key":
            if ch == '"':
                self.value = JsonPrefix()
                self.value.feed(ch)
                self.state = "key_string"
            else:
                self._expect(ch == "}", "next", end_item=True)
        elif state == "colon":
            self._expect(ch == ":", "value")
        elif state == "after_value":
            if ch == ",":
                self.state = "key"
            else:
                self._expect(ch == "}", "next", end_item=True)
        elif state == "next":
            if ch == ",":
                self.state = "item"
            else:
                self._expect(ch == "]", "end")

    def _expect(self, ok: bool, then: str, end_item: bool = False) -> None:
        if not ok:
            self._die()
            return
        if end_item:  # an item without parameters gets `{}`
            self._close_args()
        self.state = then

    def _value_char(self, ch: str) -> None:
        if self.value is None:
            if ch in _WS:
                return  # the value's text starts at its first character
            self.value, self.sent = JsonPrefix(), 0
        value = self.value
        value.feed(ch)
        if self._streaming():
            self._emit_args(value)
        if value.done:
            self._value_done()
        elif value.error:  # also a bare number: the grammar writes none outside the arguments
            self._die()

    def _value_done(self) -> None:
        value = self.value
        assert value is not None
        self.value = None
        if self.mode == "named":  # its arguments went out as they were read
            self.call_open, self.state = False, "end"  # what follows is not the call's
            return
        self.state = "after_value"
        if self.key == "name":
            name = json.loads(value.text)
            if isinstance(name, str) and self.name is None:
                self.name = name
                self._open(name)
                if self.early_args is not None:
                    self._events.append(("args", self.early_args))
                    self.call_open = False
        elif self.key == "parameters":
            if self.call_open:
                self.call_open = False
            elif self.name is None:
                self.early_args = value.text

    def _streaming(self) -> bool:
        return self.key == "parameters" and self.call_open

    # ---- calls

    def _open(self, name: str) -> None:
        self.num_calls += 1
        self.call_open, self.sent = True, 0
        self._events.append(("call", name))

    def _emit_args(self, value: JsonPrefix) -> None:
        if value.closable > self.sent:
            self._events.append(("args", value.text[self.sent : value.closable]))
            self.sent = value.closable

    def _close_args(self) -> None:
        """The open call's arguments end here: what closers complete, or `{}` if none was read
        (a call cut short, or its item closed without parameters)."""
        if not self.call_open:
            return
        self.call_open = False
        value = self.value if self._in_arguments() else None
        if value is not None and value.done:
            self._emit_args(value)
        elif value is not None and value.closable:
            self._emit_args(value)
            self._events.append(("args", value.closers))
        elif not self.sent or value is None:
            self._events.append(("args", "{}"))

    def _in_arguments(self) -> bool:
        return self.state == "value" and self.key == "parameters"

    def _die(self) -> None:
        """A character no constrained reply has: the call in progress is closed, the rest is
        dropped."""
        self._close_args()
        self.state = "dead"
