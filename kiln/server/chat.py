"""POST /v1/chat/completions: the model's chat template, n, stop, seed, logprobs, streaming with
`stream_options.include_usage`. The prompt ids are exactly those `LLM.chat` uses, so greedy
output equals the offline API's."""

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
from kiln.server.chat_stream import reply_chunks
from kiln.server.errors import error_body
from kiln.server.generation import (
    SSE_DONE,
    ChunkFrames,
    ClientDisconnected,
    EngineRequest,
    Generation,
    close_later,
    sse,
    unless_disconnected,
)
from kiln.server.logprobs import chat_logprobs
from kiln.server.params import build_sampling_params, check_max_tokens
from kiln.server.protocol import (
    ERROR_RESPONSES,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
)
from kiln.server.reasoning import ReasoningParser
from kiln.server.reply import ReplyStream, reasoning_for, whole_reply
from kiln.server.state import ServerState, State, text_size
from kiln.server.tool_calls import (
    ToolPlan,
    apply_plan,
    detect_parser,
    get_parser,
    plan_tools,
)
from kiln.server.tool_calls.parsers import ToolCallParser
from kiln.server.tool_calls.request import template_tool_call
from kiln.server.tool_calls.template import check_auto_tools_shown

router = APIRouter()


def chat_prompt_ids(
    state: ServerState,
    messages: list[ChatMessage],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
) -> list[int]:
    """Template -> text -> ids, as LLM.chat does (the template already holds any BOS token)."""
    if add_generation_prompt and continue_final_message:
        raise InvalidRequestError(
            "continue_final_message needs add_generation_prompt=false (as vLLM)",
            param="continue_final_message",
        )
    if continue_final_message and messages[-1].role != "assistant":
        raise InvalidRequestError(
            "continue_final_message needs the last message to be the assistant's",
            param="continue_final_message",
        )
    tokenizer = state.require_tokenizer("messages")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model has no chat template", param="messages")
    # Before the template's work: every field it may render counts (tools, call arguments).
    state.check_messages([_text(m) for m in messages], text_size([messages, tools]))
    conversation = [template_message(m) for m in messages]
    if state.prompt_lines is not None:  # lines that change every request: keep the prefix
        conversation = state.prompt_lines.apply(conversation)
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tools,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )
    except Exception as exc:  # a template may reject a conversation (e.g. role order)
        raise InvalidRequestError(f"the chat template failed: {exc}", param="messages") from exc
    state.check_prompt_size(len(text), "messages")  # what the template made of it, unread yet
    return list(tokenizer.encode(text, add_special_tokens=False))


def _text(message: ChatMessage) -> str:
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "\n".join(part.text for part in message.content)


def _refuse_unsupported(body: ChatCompletionRequest) -> None:
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs=true", param="top_logprobs")


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={200: {"model": ChatCompletionResponse}, **ERROR_RESPONSES},
)
async def create_chat_completion(
    body: ChatCompletionRequest, raw: Request, state: State
) -> Response:
    lora = state.check_model(body.model)
    _refuse_unsupported(body)
    tool_plan = plan_tools(
        body.tools, body.tool_choice, body.parallel_tool_calls, tool_call_parser(state)
    )
    if tool_plan is not None and tool_plan.mode == "auto":
        check_auto_tools_shown(state.require_tokenizer("messages"), state.model_name)
    # Always a thread: a template can take seconds over a short conversation or large tools.
    prompt_ids = await run_in_threadpool(
        chat_prompt_ids,
        state,
        body.messages,
        body.add_generation_prompt is not False,
        bool(body.continue_final_message),
        tool_plan.tools if tool_plan else None,
    )
    check_max_tokens(
        body.max_completion_tokens or body.max_tokens, [len(prompt_ids)], state.max_model_len
    )
    last = body.messages[-1]
    echoed = _text(last) if body.echo and last.role == "assistant" else ""
    num_top = body.top_logprobs or 0
    params = build_sampling_params(
        body,
        state.defaults,
        state.vocab_size,
        max_tokens=body.max_completion_tokens or body.max_tokens or state.max_tokens_default,
        logprobs=num_top if body.logprobs else None,
    )
    params = apply_plan(tool_plan, params)
    reasoning = reasoning_for(state.reasoning_parser, state.tokenizer, prompt_ids)
    req_id = state.new_id("chatcmpl")
    head = {"id": req_id, "created": int(time.time()), "model": state.response_model(lora)}
    engine_request = EngineRequest(req_id, prompt_ids, params, body.priority or 0, lora)
    gen = await Generation.start(state.engine, state.lifecycle, state.metrics, [engine_request])
    n = params.n
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        chunks = _stream(
            gen,
            state,
            head,
            n,
            len(prompt_ids),
            num_top,
            include_usage,
            echoed,
            tool_plan,
            reasoning,
        )
        return StreamingResponse(
            chunks, media_type="text/event-stream", background=BackgroundTask(close_later, gen)
        )

    return await _complete(
        gen,
        raw,
        state,
        head,
        n,
        num_top,
        bool(body.logprobs),
        echoed,
        tool_plan,
        len(prompt_ids),
        reasoning,
    )


async def _complete(
    gen: Generation,
    raw: Request,
    state: State,
    head: dict,
    n: int,
    num_top: int,
    want_logprobs: bool,
    echoed: str,
    tool_plan: ToolPlan | None,
    num_prompt_tokens: int,
    reasoning: tuple[ReasoningParser | None, bool] = (None, False),
) -> Response:
    """A non-streaming chat completion: every choice's text, tokens and logprobs gathered,
    then one JSON body."""
    texts = [echoed] * n
    token_ids: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[dict] | None] = [[] if want_logprobs else None for _ in range(n)]
    finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n

    async def collect() -> None:
        async for _, delta in gen.deltas():
            for out in delta.outputs:
                texts[out.index] += out.text
                token_ids[out.index] += out.token_ids
                choice_logprobs = logprobs[out.index]
                if choice_logprobs is not None and out.logprobs:
                    entries = chat_logprobs(state.tokenizer, out.token_ids, out.logprobs, num_top)
                    choice_logprobs.extend(entries)
                if out.finish_reason is not None:
                    finish[out.index] = (out.finish_reason, out.stop_reason)

    try:
        await unless_disconnected(raw, collect())
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        gen.close()
    completion_tokens = sum(len(ids) for ids in token_ids)
    messages = [reply_message(tool_plan, texts[i], finish[i][0], reasoning) for i in range(n)]
    return JSONResponse(
        {
            **head,
            "object": "chat.completion",
            "choices": [
                {
                    "index": i,
                    "message": messages[i][0],
                    "logprobs": None if logprobs[i] is None else {"content": logprobs[i]},
                    "finish_reason": messages[i][1],
                    "stop_reason": finish[i][1],
                }
                for i in range(n)
            ],
            "usage": _usage(num_prompt_tokens, completion_tokens),
        }
    )


def template_message(m: ChatMessage) -> dict:
    """A message as chat templates read it: tool calls with their arguments as objects (the
    templates apply `tojson`), a tool result with the call it answers."""
    message: dict = {"role": "system" if m.role == "developer" else m.role, "content": _text(m)}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        message["tool_calls"] = [
            template_tool_call(call.model_dump(exclude_none=True)) for call in m.tool_calls
        ]
    return message


def tool_call_parser(state: ServerState) -> ToolCallParser:
    if state.tool_call_parser is not None:
        parser = get_parser(state.tool_call_parser)
    else:
        parser = detect_parser(getattr(state.tokenizer, "chat_template", None))
    if parser.needs_special_tokens:  # the reply keeps them: its EOS text is no content
        parser.end_text = getattr(state.tokenizer, "eos_token", None)
    return parser


def reply_message(
    plan: ToolPlan | None,
    text: str,
    finish: str | None,
    reasoning: tuple[ReasoningParser | None, bool] = (None, False),
) -> tuple[dict, str | None]:
    """The assistant message of a whole reply, and its finish_reason ("tool_calls" when the
    reply is calls, as OpenAI; a reply cut short by max_tokens stays "length", its calls
    closed as when streamed). `reasoning_content` with a reasoning parser (vLLM's field)."""
    if plan is None and reasoning[0] is None:
        return {"role": "assistant", "content": text}, finish
    reply = whole_reply(text, reasoning[0], reasoning[1], plan)
    content, calls = reply.content, reply.calls
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning[0] is not None:
        message["reasoning_content"] = reply.reasoning
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
        return message, "tool_calls" if finish == "stop" else finish
    return message, finish


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


async def _stream(
    gen: Generation,
    state: ServerState,
    head: dict,
    n: int,
    num_prompt_tokens: int,
    num_top: int,
    include_usage: bool,
    echoed: str,
    tool_plan: ToolPlan | None = None,
    reasoning: tuple[ReasoningParser | None, bool] = (None, False),
) -> AsyncIterator[bytes]:
    head = {**head, "object": "chat.completion.chunk"}
    frames = ChunkFrames(head)

    def chunk(index: int, delta: dict, logprobs=None, finish=(None, None)) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs}
        choice["finish_reason"], choice["stop_reason"] = finish
        return frames.chunk(choice)

    completion_tokens = 0
    parsed = tool_plan is not None or reasoning[0] is not None
    replies = [
        ReplyStream(reasoning[0], reasoning[1], tool_plan) if parsed else None for _ in range(n)
    ]
    try:
        for i in range(n):  # the role first, as OpenAI streams it
            yield chunk(i, {"role": "assistant", "content": echoed})
        async for batch in gen.batches():
            chunks = []  # what arrived since the last write: one write
            for _, delta in batch:
                for out in delta.outputs:
                    completion_tokens += len(out.token_ids)
                    if not out.token_ids and out.finish_reason is None:
                        continue  # a chunk per token, text or not: clients time them by chunks
                    lps = None
                    if out.logprobs:
                        entries = chat_logprobs(
                            state.tokenizer, out.token_ids, out.logprobs, num_top
                        )
                        lps = {"content": entries}
                    reply = replies[out.index]
                    if reply is not None:
                        for part in reply_chunks(reply, out.text, out.finish_reason, lps):
                            chunks.append(chunk(out.index, *part[:2], (part[2], out.stop_reason)))
                        continue
                    content = {"content": out.text} if out.text or out.token_ids else {}
                    finish = (out.finish_reason, out.stop_reason)
                    chunks.append(chunk(out.index, content, lps, finish))
            if chunks:
                yield b"".join(chunks)
        if include_usage:
            usage = _usage(num_prompt_tokens, completion_tokens)
            yield sse({**head, "choices": [], "usage": usage})
        yield SSE_DONE
    except InvalidRequestError as exc:  # its grammar failed to compile after it was accepted
        yield sse(error_body(400, str(exc), exc.param, exc.code))
        yield SSE_DONE
    except Exception as exc:  # the engine died mid-stream: say so, then end the stream
        yield sse(error_body(503, f"generation failed: {exc}", code="engine_dead"))
        yield SSE_DONE
    finally:
        gen.close()
