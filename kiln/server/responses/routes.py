"""OpenAI's Responses API: POST /v1/responses (streamed as OpenAI's events, or whole), GET and
DELETE /v1/responses/{id}. A turn with `previous_response_id` continues the stored conversation:
its prompt is that conversation's messages, then the new input, rendered by the chat template,
so the prompt of the turn before is its prefix and the prefix cache serves it."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kiln.errors import InvalidRequestError
from kiln.server.chat import chat_prompt_ids, tool_call_parser
from kiln.server.errors import APIError
from kiln.server.generation import (
    ClientDisconnected,
    EngineRequest,
    Generation,
    close_later,
    unless_disconnected,
)
from kiln.server.params import build_sampling_params, check_max_tokens
from kiln.server.protocol import ERROR_RESPONSES, ChatMessage
from kiln.server.reply import ReplyStream, reasoning_for, whole_reply
from kiln.server.responses.items import OutputBuilder, assistant_turns, whole_output
from kiln.server.responses.request import (
    ResponsesRequest,
    chat_tool_choice,
    chat_tools,
    input_messages,
)
from kiln.server.responses.store import ResponseStore, StoredResponse, json_bytes
from kiln.server.state import ServerState, State
from kiln.server.tool_calls import ToolPlan, apply_plan, plan_tools
from kiln.server.tool_calls.template import check_auto_tools_shown

router = APIRouter()


def _store(raw: Request) -> ResponseStore:
    return raw.app.state.responses


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"No response found with id '{response_id}'.", param=param, code="not_found"
    )


class _Turn:
    """One create request, prepared: its conversation, prompt, tool plan and the response's
    fixed fields."""

    def __init__(
        self,
        body: ResponsesRequest,
        state: ServerState,
        conversation: list[ChatMessage],
        prompt_ids: list[int],
        plan: ToolPlan | None,
    ) -> None:
        self.body = body
        self.conversation = conversation
        self.prompt_ids = prompt_ids
        self.plan = plan
        self.tokenizer = state.tokenizer
        self.reasoning = reasoning_for(state.reasoning_parser, state.tokenizer, prompt_ids)
        self.response: dict[str, Any] = {
            "id": state.new_id("resp").replace("-", "_"),
            "object": "response",
            "created_at": int(time.time()),
            "model": state.model_name,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {},
            "output": [],
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": body.reasoning or {"effort": None, "summary": None},
            "store": body.store is not False,
            "temperature": body.temperature,
            "text": body.text or {"format": {"type": "text"}},
            "tool_choice": body.tool_choice or "auto",
            "tools": body.tools or [],
            "top_p": body.top_p,
            "truncation": "disabled",
            "usage": None,
            "user": body.user,
        }

    def finish(
        self,
        items: list[dict[str, Any]],
        finish_reason: str | None,
        num_output_tokens: int,
        num_cached_tokens: int,
        store: ResponseStore,
    ) -> dict[str, Any]:
        response = self.response
        response["output"] = items
        response["status"] = "completed"
        if finish_reason == "length":
            response["status"] = "incomplete"
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        reasoning_tokens = min(self._reasoning_tokens(items), num_output_tokens)
        response["usage"] = {
            "input_tokens": len(self.prompt_ids),
            "input_tokens_details": {"cached_tokens": num_cached_tokens},
            "output_tokens": num_output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": len(self.prompt_ids) + num_output_tokens,
        }
        if response["store"]:
            store.put(StoredResponse(response, self.conversation + assistant_turns(items)))
        return response

    def _reasoning_tokens(self, items: list[dict[str, Any]]) -> int:
        """The reasoning's length in tokens, re-encoded from its text (the tags excluded)."""
        text = "".join(p["text"] for i in items if i["type"] == "reasoning" for p in i["content"])
        if not text or self.tokenizer is None:
            return 0
        return len(self.tokenizer.encode(text, add_special_tokens=False))


@router.post("/v1/responses", response_model=None, responses=ERROR_RESPONSES)
async def create_response(body: ResponsesRequest, raw: Request, state: State) -> Response:
    lora = state.check_model(body.model)
    if (body.n or 1) != 1:
        raise InvalidRequestError("the Responses API makes one reply: n must be 1", param="n")
    store = _store(raw)
    conversation: list[ChatMessage] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise _not_found(body.previous_response_id, "previous_response_id")
        conversation = list(previous.conversation)
    conversation += input_messages(body)
    if not conversation:
        raise InvalidRequestError("input has no items", param="input")
    messages = conversation
    if body.instructions:  # not carried over to the next turn, as OpenAI
        messages = [ChatMessage(role="system", content=body.instructions), *conversation]
    plan = plan_tools(
        chat_tools(body.tools),
        chat_tool_choice(body.tool_choice),
        body.parallel_tool_calls,
        tool_call_parser(state),
    )
    if plan is not None and plan.mode == "auto":
        check_auto_tools_shown(state.require_tokenizer("input"), state.model_name)
    prompt_ids = await run_in_threadpool(  # always a thread: templates can be slow (as chat)
        chat_prompt_ids, state, messages, True, False, plan.tools if plan else None
    )
    check_max_tokens(body.max_output_tokens, [len(prompt_ids)], state.max_model_len)
    max_tokens = body.max_output_tokens or state.max_tokens_default
    params = build_sampling_params(body, state.defaults, state.vocab_size, max_tokens=max_tokens)
    params = apply_plan(plan, params)
    turn = _Turn(body, state, conversation, prompt_ids, plan)
    turn.response["model"] = state.response_model(lora)
    request = EngineRequest(turn.response["id"], prompt_ids, params, body.priority or 0, lora)
    gen = await Generation.start(state.engine, state.lifecycle, state.metrics, [request])
    if body.stream:
        return StreamingResponse(
            _stream(gen, turn, store),
            media_type="text/event-stream",
            background=BackgroundTask(close_later, gen),
        )
    text, tokens, finish, cached = "", 0, None, 0

    async def collect() -> None:
        nonlocal text, tokens, finish, cached
        async for _, delta in gen.deltas():
            cached = max(cached, delta.num_cached_tokens)
            for out in delta.outputs:
                text += out.text
                tokens += len(out.token_ids)
                finish = out.finish_reason or finish

    try:
        await unless_disconnected(raw, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        gen.close()
    reply = whole_reply(text, turn.reasoning[0], turn.reasoning[1], plan)
    return JSONResponse(turn.finish(whole_output(reply), finish, tokens, cached, store))


def _sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + json_bytes(event) + b"\n\n"


async def _stream(gen: Generation, turn: _Turn, store: ResponseStore) -> AsyncIterator[bytes]:
    builder = OutputBuilder()
    reply = ReplyStream(turn.reasoning[0], turn.reasoning[1], turn.plan)
    tokens, finish, cached = 0, None, 0
    try:
        yield _sse(builder.event("response.created", response=dict(turn.response)))
        yield _sse(builder.event("response.in_progress", response=dict(turn.response)))
        async for batch in gen.batches():
            frames = []
            for _, delta in batch:
                cached = max(cached, delta.num_cached_tokens)
                for out in delta.outputs:
                    tokens += len(out.token_ids)
                    events = reply.feed(out.text)
                    if out.finish_reason is not None:
                        finish = out.finish_reason
                        events += reply.finish()
                    frames += [_sse(e) for e in builder.feed(events, reply.ids)]
            if frames:
                yield b"".join(frames)
        closing = [_sse(e) for e in builder.close()]
        response = turn.finish(builder.items, finish, tokens, cached, store)
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        yield b"".join(closing) + _sse(builder.event(kind, response=response))
    except InvalidRequestError as exc:
        yield _sse(builder.event("error", code=exc.code, message=str(exc), param=exc.param))
    except Exception as exc:  # the engine died mid-stream: say so, then end the stream
        message = f"generation failed: {exc}"
        yield _sse(builder.event("error", code="engine_dead", message=message, param=None))
    finally:
        gen.close()


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def retrieve_response(response_id: str, raw: Request, state: State) -> JSONResponse:
    stored = _store(raw).get(response_id)
    if stored is None:
        raise _not_found(response_id)
    return JSONResponse(stored.response)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str, raw: Request, state: State) -> JSONResponse:
    if not _store(raw).delete(response_id):
        raise _not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
