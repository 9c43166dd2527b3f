"""Anthropic's Messages API: POST /v1/messages (streamed as Anthropic's events: message_start,
content_block_start / delta / stop, message_delta, message_stop; or whole) and
POST /v1/messages/count_tokens. Content blocks come from the reply parsers: `thinking` (with a
reasoning parser), `text`, `tool_use`. Errors take Anthropic's shape on these routes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kiln.errors import InvalidRequestError
from kiln.server.chat import chat_prompt_ids, tool_call_parser
from kiln.server.errors import ERROR_SHAPES
from kiln.server.generation import (
    ClientDisconnected,
    EngineRequest,
    Generation,
    close_later,
    unless_disconnected,
)
from kiln.server.messages.request import (
    CountTokensRequest,
    MessagesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
)
from kiln.server.params import build_sampling_params, check_max_tokens
from kiln.server.reply import Event, ReplyStream, reasoning_for, whole_reply
from kiln.server.state import ServerState, State
from kiln.server.tool_calls import ToolPlan, apply_plan, plan_tools
from kiln.server.tool_calls.template import check_auto_tools_shown

router = APIRouter()
PREFIX = "/v1/messages"

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def anthropic_error(status: int, body: dict) -> dict:
    """An OpenAI error body as Anthropic's: {"type": "error", "error": {"type", "message"}}."""
    message = body.get("error", {}).get("message", "error")
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


ERROR_SHAPES[PREFIX] = anthropic_error


def _sse(kind: str, data: dict[str, Any]) -> bytes:
    return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **data}) + b"\n\n"


def _stop_reason(finish: str | None, stop: int | str | None, calls: bool) -> tuple[str, str | None]:
    if finish == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


async def _prepare(
    body: MessagesRequest, state: ServerState
) -> tuple[list[int], ToolPlan | None, EngineRequest]:
    lora = state.check_model(body.model)
    choice, parallel = chat_tool_choice(body.tool_choice)
    plan = plan_tools(chat_tools(body.tools), choice, parallel, tool_call_parser(state))
    if plan is not None and plan.mode == "auto":
        check_auto_tools_shown(state.require_tokenizer("messages"), state.model_name)
    messages = chat_messages(body)
    prompt_ids = await run_in_threadpool(  # always a thread: templates can be slow (as chat)
        chat_prompt_ids, state, messages, True, False, plan.tools if plan else None
    )
    check_max_tokens(body.max_tokens, [len(prompt_ids)], state.max_model_len)
    fields = body.model_copy(update={"stop": body.stop_sequences, "n": 1})
    params = build_sampling_params(
        fields, state.defaults, state.vocab_size, max_tokens=body.max_tokens
    )
    params = apply_plan(plan, params)
    request = EngineRequest(state.new_id("msg").replace("-", "_"), prompt_ids, params, 0, lora)
    return prompt_ids, plan, request


@router.post(PREFIX, response_model=None)
async def create_message(body: MessagesRequest, raw: Request, state: State) -> Response:
    prompt_ids, plan, request = await _prepare(body, state)
    reasoning = reasoning_for(state.reasoning_parser, state.tokenizer, prompt_ids)
    head = {
        "id": request.req_id,
        "type": "message",
        "role": "assistant",
        "model": body.model or state.model_name,
    }
    gen = await Generation.start(state.engine, state.lifecycle, state.metrics, [request])
    if body.stream:
        reply = ReplyStream(reasoning[0], reasoning[1], plan)
        return StreamingResponse(
            _stream(gen, head, reply, len(prompt_ids)),
            media_type="text/event-stream",
            background=BackgroundTask(close_later, gen),
        )
    text, tokens, cached = "", 0, 0
    finish: tuple[str | None, int | str | None] = (None, None)

    async def collect() -> None:
        nonlocal text, tokens, cached, finish
        async for _, delta in gen.deltas():
            cached = max(cached, delta.num_cached_tokens)
            for out in delta.outputs:
                text += out.text
                tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    finish = (out.finish_reason, out.stop_reason)

    try:
        await unless_disconnected(raw, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        gen.close()
    whole = whole_reply(text, reasoning[0], reasoning[1], plan)
    content: list[dict[str, Any]] = []
    if whole.reasoning:
        content.append({"type": "thinking", "thinking": whole.reasoning, "signature": ""})
    if whole.content:
        content.append({"type": "text", "text": whole.content})
    for call in whole.calls:
        tool_id = "toolu_" + call.id.removeprefix("call_")
        content.append(
            {
                "type": "tool_use",
                "id": tool_id,
                "name": call.name,
                "input": json.loads(call.arguments),
            }
        )
    stop_reason, stop_sequence = _stop_reason(*finish, bool(whole.calls))
    usage = {"input_tokens": len(prompt_ids), "output_tokens": tokens}
    usage["cache_read_input_tokens"] = cached
    return JSONResponse(
        {
            **head,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }
    )


class _Blocks:
    """Content blocks opened and closed as the reply's events arrive."""

    def __init__(self, reply: ReplyStream) -> None:
        self.reply = reply
        self.index = -1
        self.open: str | None = None  # the open block's type

    def feed(self, events: list[Event]) -> list[bytes]:
        out: list[bytes] = []
        for kind, value in events:
            if kind == "reasoning":
                out += self._ensure(
                    "thinking", {"type": "thinking", "thinking": "", "signature": ""}
                )
                out.append(self._delta({"type": "thinking_delta", "thinking": value}))
            elif kind == "content":
                out += self._ensure("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": value}))
            elif kind == "call":
                out += self.close()
                tool_id = "toolu_" + self.reply.ids[-1].removeprefix("call_")
                block = {"type": "tool_use", "id": tool_id, "name": value, "input": {}}
                out += self._start("tool_use", block)
            else:
                out.append(self._delta({"type": "input_json_delta", "partial_json": value}))
        return out

    def close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"index": self.index})]

    def _ensure(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        if self.open == kind:
            return []
        return self.close() + self._start(kind, block)

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        self.index += 1
        self.open = kind
        return [_sse("content_block_start", {"index": self.index, "content_block": block})]

    def _delta(self, delta: dict[str, Any]) -> bytes:
        return _sse("content_block_delta", {"index": self.index, "delta": delta})


async def _stream(
    gen: Generation, head: dict, reply: ReplyStream, num_prompt_tokens: int
) -> AsyncIterator[bytes]:
    blocks = _Blocks(reply)
    tokens, cached = 0, 0
    finish: tuple[str | None, int | str | None] = (None, None)
    try:
        start = {**head, "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": num_prompt_tokens, "output_tokens": 0}
        yield _sse("message_start", {"message": start})
        async for batch in gen.batches():
            frames: list[bytes] = []
            for _, delta in batch:
                cached = max(cached, delta.num_cached_tokens)
                for out in delta.outputs:
                    tokens += len(out.token_ids)
                    events = reply.feed(out.text)
                    if out.finish_reason is not None:
                        finish = (out.finish_reason, out.stop_reason)
                        events += reply.finish()
                    frames += blocks.feed(events)
            if frames:
                yield b"".join(frames)
        stop_reason, stop_sequence = _stop_reason(*finish, bool(reply.ids))
        usage = {"output_tokens": tokens, "cache_read_input_tokens": cached}
        ending = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield b"".join(
            [
                *blocks.close(),
                _sse("message_delta", {"delta": ending, "usage": usage}),
                _sse("message_stop", {}),
            ]
        )
    except InvalidRequestError as exc:
        yield _sse("error", anthropic_error(400, {"error": {"message": str(exc)}}))
    except Exception as exc:  # the engine died mid-stream: say so, then end the stream
        body = {"error": {"message": f"generation failed: {exc}"}}
        yield _sse("error", anthropic_error(503, body))
    finally:
        gen.close()


@router.post(PREFIX + "/count_tokens")
async def count_tokens(body: CountTokensRequest, state: State) -> JSONResponse:
    prompt_ids, _, _ = await _prepare(body, state)
    return JSONResponse({"input_tokens": len(prompt_ids)})
