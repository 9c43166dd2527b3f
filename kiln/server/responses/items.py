"""A response's output items (reasoning, message, function_call) built from one reply's events
(kiln/server/reply.py), with the stream events OpenAI names for each step: an item is added,
its text or arguments grow by deltas, it is done. The whole-reply path feeds the same builder
all at once and keeps only the items."""

from __future__ import annotations

import uuid
from typing import Any

from kiln.server.protocol import ChatMessage, MessageToolCall
from kiln.server.reply import Event, Reply


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputBuilder:
    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._sequence = 0

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}

    def feed(self, events: list[Event], call_ids: list[str]) -> list[dict[str, Any]]:
        """Stream events for a step's reply events; `call_ids` are the reply's calls' ids."""
        out: list[dict[str, Any]] = []
        num_calls = sum(1 for i in self.items if i["type"] == "function_call")
        for kind, value in events:
            if kind == "reasoning":
                out += self._ensure("reasoning")
                out.append(self._delta("response.reasoning_text.delta", value))
            elif kind == "content":
                out += self._ensure("message")
                out.append(self._delta("response.output_text.delta", value, logprobs=[]))
            elif kind == "call":
                out += self.close()
                item: dict[str, Any] = {
                    "id": _id("fc"),
                    "type": "function_call",
                    "call_id": call_ids[num_calls],
                    "name": value,
                    "arguments": "",
                    "status": "in_progress",
                }
                num_calls += 1
                out += self._add(item)
            else:
                call = self._open
                assert call is not None and call["type"] == "function_call"
                call["arguments"] += value
                out.append(
                    self._event_on_item("response.function_call_arguments.delta", delta=value)
                )
        return out

    def close(self) -> list[dict[str, Any]]:
        """Events that finish the open item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        out = []
        index = len(self.items) - 1
        where = {"item_id": item["id"], "output_index": index}
        if item["type"] == "function_call":
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    arguments=item["arguments"],
                    name=item["name"],
                )
            )
        else:
            part = item["content"][0]
            kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
            extra: dict[str, Any] = {} if kind == "reasoning_text" else {"logprobs": []}
            out.append(
                self.event(
                    f"response.{kind}.done", **where, content_index=0, text=part["text"], **extra
                )
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=index, item=item))
        return out

    def _ensure(self, kind: str) -> list[dict[str, Any]]:
        if self._open is not None and self._open["type"] == kind:
            return []
        out = self.close()
        item: dict[str, Any]
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "status": "in_progress"}
            part: dict[str, Any] = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant"}
            item["status"] = "in_progress"
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"] = []
        out += self._add(item)
        item["content"].append(part)
        out.append(
            self._event_on_item("response.content_part.added", content_index=0, part=dict(part))
        )
        return out

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        snapshot = {**item, "content": []} if "content" in item else dict(item)
        return [
            self.event(
                "response.output_item.added", output_index=len(self.items) - 1, item=snapshot
            )
        ]

    def _delta(self, kind: str, text: str, **extra: Any) -> dict[str, Any]:
        assert self._open is not None
        self._open["content"][0]["text"] += text
        return self._event_on_item(kind, content_index=0, delta=text, **extra)

    def _event_on_item(self, kind: str, **fields: Any) -> dict[str, Any]:
        assert self._open is not None
        return self.event(
            kind, item_id=self._open["id"], output_index=len(self.items) - 1, **fields
        )


def whole_output(reply: Reply) -> list[dict[str, Any]]:
    """The output items of a whole reply."""
    events: list[Event] = []
    if reply.reasoning:
        events.append(("reasoning", reply.reasoning))
    if reply.content:
        events.append(("content", reply.content))
    for call in reply.calls:
        events += [("call", call.name), ("args", call.arguments)]
    builder = OutputBuilder()
    builder.feed(events, [c.id for c in reply.calls])
    builder.close()
    return builder.items


def assistant_turns(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """The output as the conversation's assistant turn, for the next turn's prompt (reasoning
    is left out, as chat templates leave out earlier turns' reasoning)."""
    text = "".join(part["text"] for i in items if i["type"] == "message" for part in i["content"])
    calls = [
        MessageToolCall.model_validate(
            {"id": i["call_id"], "function": {"name": i["name"], "arguments": i["arguments"]}}
        )
        for i in items
        if i["type"] == "function_call"
    ]
    return [ChatMessage(role="assistant", content=text, tool_calls=calls or None)]


def output_text(items: list[dict[str, Any]]) -> str:
    return "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
