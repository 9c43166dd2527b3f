"""Streaming an `auto` reply: content streams until something that may start a tool call; that
text is held back, and at the end it becomes tool_calls deltas (or, if it was no call after all,
content)."""

from __future__ import annotations

from kiln.server.tool_calls.request import ToolPlan


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # everything so far
        self.sent = 0  # chars of `text` already streamed as content
        self.holding = plan.mode != "auto"  # required / named: the whole reply is the call

    def feed(self, delta: str) -> str:
        """Content that can be sent now."""
        self.text += delta
        parser = self.plan.parser
        if self.holding or parser is None:  # no parser: required / named, held from the start
            return ""
        start = self.sent
        if parser.at_start_only:
            if self.sent == 0:
                head = self.text.lstrip()
                if not head or any(m.startswith(head) for m in parser.markers):
                    return ""  # undecided yet
                if any(head.startswith(m) for m in parser.markers):
                    self.holding = True
                    return ""
            out, self.sent = self.text[start:], len(self.text)
            return out
        # Anywhere in the text: send up to the marker, or up to a possible marker's prefix.
        for marker in parser.markers:
            at = self.text.find(marker, start)
            if at >= 0:
                self.holding = True
                out, self.sent = self.text[start:at], at
                return out
        keep = _partial_marker(self.text, parser.markers)
        end = len(self.text) - keep
        out, self.sent = self.text[start:end], max(end, start)
        return out

    def finish(self) -> tuple[str, list[dict]]:
        """(content still to send, tool_calls deltas) once the reply is complete."""
        content, calls = self.plan.message(self.text)
        if not calls:
            rest = self.text[self.sent :]
            self.sent = len(self.text)
            return rest, []
        # Content before the first call was streamed already; what is left (text after the
        # calls) goes out now, then the calls, whole, one delta each.
        streamed = self.text[: self.sent].strip()
        rest = (content or "").strip()
        rest = rest[len(streamed) :].strip() if rest.startswith(streamed) else ""
        return rest, [c.to_openai(i) for i, c in enumerate(calls)]


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), 0, -1):
            if text.endswith(marker[:n]):
                best = max(best, n)
                break
    return best


def tool_call_chunks(
    stream: ToolCallStream, text: str, finish_reason: str | None, logprobs: object
) -> list[tuple[dict, object, str | None]]:
    """(delta, logprobs, finish_reason) chunks for one step's text of one choice: a chunk per
    step even while a call is held back (clients time tokens by chunks); at the end any content
    left, the calls, then the finish ("tool_calls" when calls were made, as OpenAI)."""
    content = stream.feed(text)
    if finish_reason is None:
        return [({"content": content} if content else {}, logprobs, None)]
    calls: list[dict]
    if finish_reason == "length":  # cut short: what was held is text, not a call
        rest, calls = stream.text[stream.sent :], []
        stream.sent = len(stream.text)
    else:
        rest, calls = stream.finish()
    chunks: list[tuple[dict, object, str | None]] = []
    if content or rest or logprobs:
        chunks.append(({"content": content + rest}, logprobs, None))
    if calls:
        chunks.append(({"tool_calls": calls}, None, None))
        if finish_reason == "stop":
            finish_reason = "tool_calls"
    chunks.append(({}, None, finish_reason))
    return chunks
