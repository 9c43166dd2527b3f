"""One reply's parts, for every API that formats them: reasoning (a reasoning parser's `<think>`
block), content, and tool calls (the request's ToolPlan), whole or fed piece by piece.

Events: ("reasoning", text), ("content", text), ("call", name) opening call number
`len(ids) - 1` whose id is `ids[-1]`, ("args", text) extending that call's arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.server.reasoning import ReasoningParser, get_reasoning_parser
from kiln.server.tool_calls.guided import GuidedCallScanner
from kiln.server.tool_calls.parsers import ToolCall, new_call_id
from kiln.server.tool_calls.request import ToolPlan
from kiln.server.tool_calls.scanner import CallScanner

Event = tuple[str, str]


@dataclass
class Reply:
    reasoning: str | None
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)


def whole_reply(
    text: str, reasoning: ReasoningParser | None, prompt_open: bool, plan: ToolPlan | None
) -> Reply:
    """A whole reply's parts (the non-streaming path: each parser's `parse`)."""
    end_text = _end_text(plan)
    if end_text:
        text = text.removesuffix(end_text)
    thought = None
    content: str | None = text
    if reasoning is not None:
        thought, content = reasoning.parse(text, prompt_open)
    if plan is None:
        return Reply(thought, content)
    message, calls = plan.message(content or "")
    return Reply(thought, message, calls)


class ReplyStream:
    def __init__(
        self, reasoning: ReasoningParser | None, prompt_open: bool, plan: ToolPlan | None
    ) -> None:
        self.reasoning = reasoning.scanner(prompt_open) if reasoning is not None else None
        self.plan = plan
        parser = plan.parser if plan is not None and plan.mode == "auto" else None
        self.calls: CallScanner | GuidedCallScanner | None = None
        if parser is not None:
            self.calls = CallScanner(parser)
        elif plan is not None:  # required / named: the whole reply is the calls
            self.calls = plan.guided_scanner()
        self.ids: list[str] = []
        self.end_text = _end_text(plan)
        self._tail = ""  # what may be the end-of-sequence token's text, held back

    def feed(self, text: str) -> list[Event]:
        if self.end_text:
            text, self._tail = _hold_suffix(self._tail + text, self.end_text)
        if self.reasoning is None:
            return self._content(text, False)
        return self._split(self.reasoning.feed(text), False)

    def finish(self) -> list[Event]:
        rest = self._tail.removesuffix(self.end_text or "")
        self._tail = ""
        if self.reasoning is None:
            return self._content(rest, True)
        return self._split(self.reasoning.feed(rest) + self.reasoning.finish(), True)

    def _split(self, events: list[Event], final: bool) -> list[Event]:
        out: list[Event] = []
        text = ""
        for kind, value in events:
            if kind == "reasoning":
                out.append((kind, value))
            else:
                text += value
        return out + self._content(text, final)

    def _content(self, text: str, final: bool) -> list[Event]:
        plan = self.plan
        if plan is None:
            return [("content", text)] if text else []
        assert self.calls is not None  # every plan has its scanner
        events = self.calls.feed(text) if text else []
        if final:
            events += self.calls.finish()
        return self._number(events)

    def _number(self, events: list[Event]) -> list[Event]:
        """Ids for new calls; with parallel_tool_calls=false, only the first call."""
        out: list[Event] = []
        dropping = False
        for kind, value in events:
            if kind == "call":
                dropping = bool(self.ids) and self.plan is not None and not self.plan.parallel
                if not dropping:
                    self.ids.append(new_call_id())
            if kind in ("call", "args") and dropping:
                continue
            out.append((kind, value))
        return out


def _end_text(plan: ToolPlan | None) -> str | None:
    """The end-of-sequence token's text, when the plan keeps special tokens in the reply (the
    detokenizer then writes it at the end, and it is not the model's content)."""
    if plan is None or plan.parser is None:
        return None
    return plan.parser.end_text


def _hold_suffix(text: str, end: str) -> tuple[str, str]:
    """(what can go now, what may be the start of `end` or `end` itself, held)."""
    if text.endswith(end):
        return text[: -len(end)], end
    for n in range(min(len(end) - 1, len(text)), 0, -1):
        if text.endswith(end[:n]):
            return text[:-n], text[-n:]
    return text, ""


def reasoning_for(
    name: str | None, tokenizer: object, prompt_ids: list[int]
) -> tuple[ReasoningParser | None, bool]:
    """The server's reasoning parser (None without --reasoning-parser) and whether the prompt's
    last tokens leave its block open (the template wrote the start tag for the model)."""
    if name is None:
        return None, False
    parser = get_reasoning_parser(name)
    decode = getattr(tokenizer, "decode", None)
    tail = decode(prompt_ids[-8:]) if decode is not None and prompt_ids else ""
    return parser, parser.opens(tail)
