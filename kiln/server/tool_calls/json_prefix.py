"""An incremental JSON scanner that knows, after every character, whether the text so far can be
closed into valid JSON by appending closers (`"`, `}`, `]`) alone, and with which: what lets a
tool call's arguments stream as the model writes them and still never be malformed (a call cut
short is closed, not left broken)."""

from __future__ import annotations

_WS = " \t\r\n"
_LITERALS = ("true", "false", "null")
_NUMBER_START = "-0123456789"
_NUMBER_CHARS = "0123456789+-.eE"


class JsonPrefix:
    """Feed characters; `closable` is the longest consumed prefix that closers complete, and
    `closers` what completes it. `done` once one whole value has been read (the characters after
    it are not consumed); `error` once a character cannot continue any JSON value."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self.error = False
        self.closable = 0
        self.closers = ""
        self._stack: list[str] = []  # "{" or "["
        # "value", "key_or_end", "key", "colon", "after", "string", "escape", "unicode",
        # "number", "literal"
        self._state = "value"
        self._in_key = False
        self._pending = ""  # the literal or number being read; unicode digits left

    def feed(self, chars: str) -> int:
        """Consume from `chars` until the value is done or an error; returns how many."""
        used = 0
        for ch in chars:
            if self.done or self.error:
                break
            if not self._step(ch):
                self.error = True
                break
            used += 1
            self.text += ch
            self._mark()
            if self._state == "after" and not self._stack:
                self.done = True
        return used

    def finish_number(self) -> None:
        """At the end of the text: a number in progress ends here (a top-level `12` is done)."""
        if self._state == "number" and self._number_complete() and not self._stack:
            self._state = "after"
            self.done = True

    def closed(self) -> str:
        """The closable prefix, closed: always valid JSON once anything closable was read."""
        return self.text[: self.closable] + self.closers

    def _container_closers(self) -> str:
        return "".join("}" if c == "{" else "]" for c in reversed(self._stack))

    def _mark(self) -> None:
        state = self._state
        ok = state in ("after", "key_or_end", "array_first")
        suffix = self._container_closers()
        if state == "string" and not self._in_key:
            ok, suffix = True, '"' + suffix
        elif state == "number" and self._number_complete():
            ok = True
        if ok and (self._stack or state == "after" or state == "number"):
            self.closable, self.closers = len(self.text), suffix

    def _number_complete(self) -> bool:
        return self._pending[-1:].isdigit()

    def _begin_value(self, ch: str) -> bool:
        if ch in _WS:
            return True
        if ch == "{":
            self._stack.append("{")
            self._state = "key_or_end"
        elif ch == "[":
            self._stack.append("[")
            self._state = "array_first"
        elif ch == '"':
            self._state, self._in_key = "string", False
        elif ch in _NUMBER_START:
            self._state, self._pending = "number", ch
        elif ch in "tfn":
            self._state, self._pending = "literal", ch
        else:
            return False
        return True

    def _end_value(self) -> None:
        self._state = "after"

    def _step(self, ch: str) -> bool:
        state = self._state
        if state == "value":
            return self._begin_value(ch)
        if state == "array_first":
            if ch == "]":
                self._stack.pop()
                self._end_value()
                return True
            self._state = "value"
            return self._begin_value(ch)
        if state in ("key_or_end", "key"):
            if ch in _WS:
                return True
            if ch == '"':
                self._state, self._in_key = "string", True
                return True
            if ch == "}" and state == "key_or_end":
                self._stack.pop()
                self._end_value()
                return True
            return False
        if state == "colon":
            if ch in _WS:
                return True
            if ch == ":":
                self._state = "value"
                return True
            return False
        if state == "string":
            if ch == '"':
                if self._in_key:
                    self._state = "colon"
                else:
                    self._end_value()
            elif ch == "\\":
                self._state = "escape"
            elif ch < " ":
                return False  # control characters must be escaped
            return True
        if state == "escape":
            if ch == "u":
                self._state, self._pending = "unicode", "4"
                return True
            if ch in '"\\/bfnrt':
                self._state = "string"
                return True
            return False
        if state == "unicode":
            if ch not in "0123456789abcdefABCDEF":
                return False
            left = int(self._pending) - 1
            self._pending = str(left)
            if left == 0:
                self._state = "string"
            return True
        if state == "number":
            if ch in _NUMBER_CHARS and _number_prefix(self._pending + ch):
                self._pending += ch
                return True
            if not self._number_complete():
                return False
            self._end_value()
            return self._step(ch)
        if state == "literal":
            word = self._pending + ch
            if not any(lit.startswith(word) for lit in _LITERALS):
                return False
            self._pending = word
            if word in _LITERALS:
                self._end_value()
            return True
        # after a value
        if ch in _WS:
            return True
        if not self._stack:
            return False
        top = self._stack[-1]
        if ch == ",":
            self._state = "key" if top == "{" else "value"
            return True
        if ch == ("}" if top == "{" else "]"):
            self._stack.pop()
            self._end_value()
            return True
        return False


def _number_prefix(text: str) -> bool:
    """Whether `text` can begin a JSON number (RFC 8259's grammar, as a prefix)."""
    i, n = 0, len(text)
    if i < n and text[i] == "-":
        i += 1
        if i < n and not text[i].isdigit():
            return False
    if i < n and text[i] == "0":
        i += 1
    else:
        while i < n and text[i].isdigit():
            i += 1
    for lead, signs in ((".", ""), ("eE", "+-")):
        if i < n and text[i] in lead:
            i += 1
            if i < n and text[i] in signs:
                i += 1
            start = i
            while i < n and text[i].isdigit():
                i += 1
            if i < n and i == start:
                return False  # a fraction or exponent needs a digit
    return i == n
