"""`<think>...</think>` split off a reply, whole or streamed. The stream and `parse` are two
implementations of one contract (the conformance suite checks them against each other at every
cut): reasoning is the text between the tags, content the text after; both stripped of leading
and trailing whitespace (a stream holds a whitespace run back until text follows it)."""

from __future__ import annotations


class ReasoningParser:
    name: str = ""
    start: str = "<think>"
    end: str = "</think>"
    starts_in_reasoning: bool = False
    """The reply is reasoning from its first token even without the start tag (DeepSeek-R1's
    template writes `<think>` into the prompt)."""

    def opens(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves a reasoning block open (a template
        that writes the start tag for the model, as Qwen3's thinking variants do)."""
        return self.start in prompt_tail and self.end not in prompt_tail.rpartition(self.start)[2]

    def parse(self, text: str, prompt_open: bool = False) -> tuple[str | None, str | None]:
        """(reasoning or None, content or None) of a whole reply."""
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start) :]
        elif prompt_open or self.starts_in_reasoning:
            body = text
        else:
            return None, text.strip() or None
        reasoning, _, content = body.partition(self.end)
        return reasoning.strip() or None, content.strip() or None

    def scanner(self, prompt_open: bool = False) -> ReasoningScanner:
        return ReasoningScanner(self, prompt_open)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3: reasoning only when the reply opens `<think>` (or the prompt left one open);
    with thinking off (`enable_thinking=False`) the reply is content."""

    name = "qwen3"


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1 and its distills: reasoning until `</think>`, with or without `<think>`; a
    reply cut short before `</think>` is all reasoning."""

    name = "deepseek_r1"
    starts_in_reasoning = True


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(
            f"unknown reasoning parser {name!r}: choose from {sorted(REASONING_PARSERS)}"
        )
    return REASONING_PARSERS[name]()


class _Trim:
    """Drops leading whitespace and holds each whitespace run until text follows it."""

    def __init__(self) -> None:
        self.ws, self.started = "", False

    def __call__(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            if self.started:
                self.ws += text
            return ""
        out = self.ws + body if self.started else body.lstrip()
        self.ws, self.started = text[len(body) :], True
        return out


class ReasoningScanner:
    """Feed a reply's text deltas; get ("reasoning", text) and ("content", text) events."""

    def __init__(self, parser: ReasoningParser, prompt_open: bool = False) -> None:
        self.parser = parser
        self.prompt_open = prompt_open
        self.buf = ""
        self.state = "start"
        self._trim = {"reasoning": _Trim(), "content": _Trim()}
        self._events: list[tuple[str, str]] = []

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        return self._run(False)

    def finish(self) -> list[tuple[str, str]]:
        return self._run(True)

    def _run(self, final: bool) -> list[tuple[str, str]]:
        self._events = []
        p = self.parser
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(p.start):
                self.buf, self.state = head[len(p.start) :], "reasoning"
            elif not final and p.start.startswith(head):
                return []  # may yet open with the tag
            else:
                open_ = self.prompt_open or p.starts_in_reasoning
                self.state = "reasoning" if open_ else "content"
        if self.state == "reasoning":
            at = self.buf.find(p.end)
            if at >= 0:
                self._emit("reasoning", self.buf[:at])
                self.buf, self.state = self.buf[at + len(p.end) :], "content"
            else:
                keep = 0 if final else _partial_suffix(self.buf, p.end)
                self._emit("reasoning", self.buf[: len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep :]
        if self.state == "content":
            self._emit("content", self.buf)
            self.buf = ""
        return self._events

    def _emit(self, kind: str, text: str) -> None:
        out = self._trim[kind](text)
        if out:
            self._events.append((kind, out))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
