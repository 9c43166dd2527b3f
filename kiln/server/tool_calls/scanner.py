"""Runs a tool-call format over a reply fed piece by piece: content, call openings and argument
text come out as soon as they are certain. Events: ("content", text), ("call", name) opening the
next call, ("args", text) extending the last call's arguments. Arguments stream only up to what
closers alone complete (json_prefix.py); a call the model breaks off or garbles is closed there,
so every emitted call's arguments parse. Content is the text outside calls with its leading and
trailing whitespace dropped (a whitespace run goes out only once text follows it)."""

from __future__ import annotations

import json

from kiln.server.tool_calls.json_prefix import JsonPrefix
from kiln.server.tool_calls.parsers import ToolCallParser

Event = tuple[str, str]


class CallScanner:
    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.buf = ""  # text fed but not yet consumed
        self.state = "start" if parser.at_start_only else "text"
        self.mode = parser.first_mode  # the next header's mode
        self.after_mode = ""
        self.held = ""  # consumed while a header is undecided: content if it is no call
        self.args: JsonPrefix | None = None
        self.outer: JsonPrefix | None = None  # the object around the arguments, if any
        self.sent = 0  # characters of the current arguments emitted
        self.as_string = False  # arguments written as a JSON string: decoded whole at the end
        self.num_calls = 0
        self._ws = ""  # a whitespace run held until text follows it
        self._started = False  # any content emitted
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._run(final=False)

    def finish(self) -> list[Event]:
        return self._run(final=True)

    def _run(self, final: bool) -> list[Event]:
        self._events = []
        while getattr(self, "_" + self.state)(final):
            pass
        return self._events

    # ---- states: each consumes what it can; True when another state should run now

    def _start(self, final: bool) -> bool:
        head = self.buf.lstrip()
        if not head and not final:
            return False
        if any(head.startswith(m) for m in self.parser.markers):
            self.state = "header"
            return True
        if not final and any(m.startswith(head) for m in self.parser.markers):
            return False  # undecided yet
        self.state = "plain"
        return True

    def _plain(self, final: bool) -> bool:
        self._content(self.buf)
        self.buf = ""
        return False

    def _text(self, final: bool) -> bool:
        if self.parser.at_start_only:
            self.state = "plain"
            return True
        found = [(at, m) for m in self.parser.markers if (at := self.buf.find(m)) >= 0]
        if found:
            at, marker = min(found)
            self._content(self.buf[:at])
            self.held, self.buf = marker, self.buf[at + len(marker) :]
            self.mode, self.state = self.parser.first_mode, "header"
            return True
        keep = 0 if final else _partial_marker(self.buf, self.parser.markers)
        end = len(self.buf) - keep
        self._content(self.buf[:end])
        self.buf = self.buf[end:]
        return False

    def _header(self, final: bool) -> bool:
        status, name, end, after_mode = self.parser.header(self.buf, self.mode)
        if status == "partial" and not final:
            return False
        if status != "match":  # not a call after all: what was held is text
            self._content(self.held)
            self.held, self.state = "", "text"
            return True
        self.held = ""
        self.num_calls += 1
        self._events.append(("call", name))
        self.after_mode = after_mode
        self.as_string = self.buf[end] == '"'
        self.args, self.sent = JsonPrefix(), 0
        self.outer = None
        if after_mode != "bare":
            self.outer = JsonPrefix()
            self.outer.feed('{"a":')  # stands for the header: only the structure matters
        self.buf = self.buf[end:]
        self.state = "args"
        return True

    def _args(self, final: bool) -> bool:
        args = self.args
        assert args is not None  # set with the call's header
        used = args.feed(self.buf)
        if self.outer is not None:
            self.outer.feed(self.buf[:used])
        self.buf = self.buf[used:]
        if final and not args.done:
            args.finish_number()
        if not self.as_string:
            self._emit_args(args.text[self.sent : args.closable])
            self.sent = args.closable
        if args.done:
            if self.as_string:
                self._emit_args(_decoded(args.text))
            self.state = "object" if self.outer is not None else "after"
            return True
        if args.error or final:  # broken off: close the call; what is left is text
            self._emit_args("{}" if self.as_string else args.closers)
            self.state = "text"
            return True
        return False

    def _object(self, final: bool) -> bool:
        """The rest of the object around the arguments (keys after them, its `}`)."""
        outer = self.outer
        assert outer is not None
        self.buf = self.buf[outer.feed(self.buf) :]
        if outer.done:
            self.state = "after"
            return True
        if outer.error or final:
            self.state = "text"
            return True
        return False

    def _after(self, final: bool) -> bool:
        status, used, mode = self.parser.after(self.buf, self.after_mode, final)
        if status == "partial":
            return False
        self.held, self.buf = self.buf[:used], self.buf[used:]
        if status == "header":
            self.mode, self.state = mode, "header"
        else:
            self.held, self.state = "", "text"
        return True

    # ---- output

    def _emit_args(self, text: str) -> None:
        if text:
            self._events.append(("args", text))

    def _content(self, text: str) -> None:
        if not text:
            return
        body = text.rstrip()
        if not body:
            if self._started:
                self._ws += text
            return
        out = self._ws + body if self._started else body.lstrip()
        self._ws, self._started = text[len(body) :], True
        self._events.append(("content", out))


def _decoded(text: str) -> str:
    """Arguments a model wrote as a JSON string: its text when that is a JSON object."""
    try:
        inner = json.loads(text)
        if isinstance(inner, str) and isinstance(json.loads(inner), dict):
            return inner
    except ValueError:
        pass
    return "{}"


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best
