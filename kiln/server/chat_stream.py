"""A chat completion's stream deltas from one reply's events (kiln/server/reply.py):
`reasoning_content` (vLLM's field), `content`, and OpenAI's `tool_calls` deltas (the call's
id and name once, then its arguments as they come)."""

from __future__ import annotations

from kiln.server.reply import Event, ReplyStream


def chat_delta(stream: ReplyStream, events: list[Event]) -> dict:
    delta: dict = {}
    calls: list[dict] = []
    for kind, value in events:
        if kind in ("reasoning", "content"):
            key = "reasoning_content" if kind == "reasoning" else "content"
            delta[key] = delta.get(key, "") + value
            continue
        index = len(stream.ids) - 1
        if kind == "call":
            function = {"name": value, "arguments": ""}
            call = {"index": index, "id": stream.ids[index], "type": "function"}
            calls.append({**call, "function": function})
        elif calls and calls[-1]["index"] == index:  # one delta per call per step
            calls[-1]["function"]["arguments"] += value
        else:
            calls.append({"index": index, "function": {"arguments": value}})
    if calls:
        delta["tool_calls"] = calls
    return delta


def reply_chunks(
    stream: ReplyStream, text: str, finish_reason: str | None, logprobs: object
) -> list[tuple[dict, object, str | None]]:
    """(delta, logprobs, finish_reason) chunks for one step's text of one choice: a chunk per
    step even while nothing can be sent (clients time tokens by chunks); at the end what is
    left, then the finish ("tool_calls" when calls were made, as OpenAI)."""
    events = stream.feed(text)
    if finish_reason is None:
        return [(chat_delta(stream, events), logprobs, None)]
    delta = chat_delta(stream, events + stream.finish())
    chunks: list[tuple[dict, object, str | None]] = []
    if delta or logprobs:
        chunks.append((delta, logprobs, None))
    if stream.ids and finish_reason == "stop":
        finish_reason = "tool_calls"
    chunks.append(({}, None, finish_reason))
    return chunks
