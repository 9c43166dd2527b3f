"""POST /v1/completions: string, list or token-id prompts; stream, echo, logprobs, n.

Each prompt is one engine request; choice `i * n + j` is completion j of prompt i (OpenAI's and
vLLM's order). `echo` with `max_tokens=0` scores the prompt without generating: the engine must
generate at least one token, so one is generated and dropped. With `logprobs` that returns the
prompt's logprobs (the first is null: nothing predicts it), which is how lm-evaluation-harness's
`local-completions` computes loglikelihoods.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import APIRouter
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kiln.errors import InvalidRequestError
from kiln.lora.request import LoRARequest
from kiln.outputs import CompletionOutput, PositionLogprobs, RequestOutput
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
from kiln.server.logprobs import CompletionLogprobs, finite
from kiln.server.params import build_sampling_params, check_max_tokens
from kiln.server.protocol import ERROR_RESPONSES, CompletionRequest, CompletionResponse, Prompt
from kiln.server.state import ServerState, State, off_the_loop, text_size

router = APIRouter()


@dataclass
class _Choice:
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: CompletionLogprobs | None = None
    echoed: bool = False
    prompt_logprobs: list[dict | None] | None = None  # vLLM's format, once the prompt is scored
    prompt_logprobs_sent: bool = False


@dataclass
class _Plan:
    """What the request asked for, resolved against the model."""

    id: str
    model: str
    created: int
    n: int
    prompts: list[tuple[str | None, list[int]]]
    echo: bool
    num_prompt_logprobs: int | None  # vLLM's prompt_logprobs extra
    drop_output: bool  # max_tokens=0 with echo: the one generated token is not returned
    include_usage: bool
    requests: list[EngineRequest] = field(default_factory=list)


def _prompts(prompt: Prompt, state: ServerState) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt."""
    if isinstance(prompt, str):
        return [(prompt, state.tokenize(prompt))]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if isinstance(prompt[0], str):
        return [(p, state.tokenize(p)) for p in prompt]
    id_lists = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in id_lists:
        # The engine rejects these too, but without naming the field.
        bad = next((t for t in ids if t >= state.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {state.vocab_size})", "prompt"
            )
    return [(None, list(ids)) for ids in id_lists]


def _plan(body: CompletionRequest, state: ServerState, lora: LoRARequest | None) -> _Plan:
    if body.suffix:
        raise InvalidRequestError("suffix is not supported", param="suffix")
    n = body.n or 1
    if body.best_of is not None and body.best_of != n and not body.use_beam_search:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    echo = bool(body.echo)
    if body.max_tokens == 0 and not echo:
        raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo)", "max_tokens")
    num_prompts = len(body.prompt) if isinstance(body.prompt, list) and body.prompt else 1
    if num_prompts > 1 and not isinstance(body.prompt[0], int):
        # Counted before any prompt is tokenized: the cap bounds the work, not just the queue.
        state.lifecycle.admit(num_prompts * n, check_queue=False)
    prompts = _prompts(body.prompt, state)
    check_max_tokens(body.max_tokens, [len(ids) for _, ids in prompts], state.max_model_len)
    drop_output = body.max_tokens == 0
    want_logprobs = body.logprobs is not None
    params = build_sampling_params(
        body,
        state.defaults,
        state.vocab_size,
        max_tokens=1 if drop_output else body.max_tokens or state.max_tokens_default,
        logprobs=body.logprobs if want_logprobs and not drop_output else None,
        prompt_logprobs=_max_or_none(
            body.logprobs if want_logprobs and echo else None, body.prompt_logprobs
        ),
    )
    plan = _Plan(
        id=state.new_id("cmpl"),
        model=state.response_model(lora),
        created=int(time.time()),  # this response's, as OpenAI's (not the server's start)
        n=n,
        prompts=prompts,
        echo=echo,
        num_prompt_logprobs=body.prompt_logprobs,
        drop_output=drop_output,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
    plan.requests = [
        EngineRequest(f"{plan.id}-{i}", ids, params, body.priority or 0, lora)
        for i, (_, ids) in enumerate(prompts)
    ]
    return plan


def _advance(
    plan: _Plan,
    state: ServerState,
    choice: _Choice,
    index: int,
    delta: RequestOutput,
    out: CompletionOutput,
) -> str:
    """Fold one completion delta into its choice; returns the new text (the prompt first, when
    echoing)."""
    text = ""
    num_top = plan.num_prompt_logprobs
    if num_top is not None and choice.prompt_logprobs is None and delta.prompt_logprobs:
        choice.prompt_logprobs = _vllm_prompt_logprobs(
            plan.prompts[index][1], delta.prompt_logprobs, num_top
        )
    if plan.echo and not choice.echoed:
        choice.echoed = True
        prompt_text, prompt_ids = plan.prompts[index]
        if prompt_text is None:
            prompt_text = state.tokenizer.decode(prompt_ids) if state.tokenizer else ""
        text = prompt_text
        if choice.logprobs is not None:
            positions = delta.prompt_logprobs or [None] * len(prompt_ids)
            choice.logprobs.extend(prompt_ids, positions)
    if not plan.drop_output:
        text += out.text
        choice.num_tokens += len(out.token_ids)
        if choice.logprobs is not None and out.logprobs:
            choice.logprobs.extend(out.token_ids, out.logprobs)
    if out.finish_reason is not None:
        choice.finish_reason = "length" if plan.drop_output else out.finish_reason
        choice.stop_reason = None if plan.drop_output else out.stop_reason
    choice.text += text
    return text


def _max_or_none(*values: int | None) -> int | None:
    given = [v for v in values if v is not None]
    return max(given) if given else None


def _vllm_prompt_logprobs(
    prompt_ids: list[int], positions: list[PositionLogprobs | None], num_top: int
) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token, {token id: {logprob, rank, decoded_token}} for
    the token itself and the top `num_top` (None for the first: nothing predicts it)."""
    out: list[dict | None] = []
    for token_id, position in zip(prompt_ids, positions):
        if position is None:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {
                    "logprob": finite(lp.logprob),
                    "rank": lp.rank,
                    "decoded_token": lp.decoded_token,
                }
                for tid, lp in position.items()
                if tid == token_id or lp.rank <= num_top
            }
        )
    return out


def _choices(plan: _Plan, state: ServerState, want_logprobs: bool) -> list[_Choice]:
    return [
        _Choice(logprobs=CompletionLogprobs(state.tokenizer) if want_logprobs else None)
        for _ in range(len(plan.prompts) * plan.n)
    ]


def _usage(plan: _Plan, choices: list[_Choice]) -> dict:
    prompt_tokens = sum(len(ids) for _, ids in plan.prompts)
    completion_tokens = sum(c.num_tokens for c in choices)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _head(plan: _Plan) -> dict:
    return {
        "id": plan.id,
        "object": "text_completion",
        "created": plan.created,
        "model": plan.model,
    }


@router.post(
    "/v1/completions",
    response_model=None,
    responses={200: {"model": CompletionResponse}, **ERROR_RESPONSES},
)
async def create_completion(body: CompletionRequest, raw: Request, state: State) -> Response:
    lora = state.check_model(body.model)
    # Long text: on a thread.
    plan = await off_the_loop(text_size(body.prompt), _plan, body, state, lora)
    choices = _choices(plan, state, body.logprobs is not None)
    gen = await Generation.start(state.engine, state.lifecycle, state.metrics, plan.requests)
    if body.stream:
        return StreamingResponse(
            _stream(gen, plan, state, choices),
            media_type="text/event-stream",
            background=BackgroundTask(close_later, gen),  # in case the stream never started
        )

    async def collect() -> None:
        async for index, delta in gen.deltas():
            for out in delta.outputs:
                _advance(plan, state, choices[index * plan.n + out.index], index, delta, out)

    try:
        await unless_disconnected(raw, collect())
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it; the requests are aborted
    finally:
        gen.close()
    result = {
        **_head(plan),
        "choices": [
            {
                "index": i,
                "text": c.text,
                "logprobs": c.logprobs.take() if c.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                **(
                    {"prompt_logprobs": c.prompt_logprobs}
                    if plan.num_prompt_logprobs is not None
                    else {}
                ),
            }
            for i, c in enumerate(choices)
        ],
        "usage": _usage(plan, choices),
    }
    return JSONResponse(result)


async def _stream(
    gen: Generation, plan: _Plan, state: ServerState, choices: list[_Choice]
) -> AsyncIterator[bytes]:
    frames = ChunkFrames(_head(plan))
    try:
        async for batch in gen.batches():
            chunks = []  # what arrived since the last write: one write
            for index, delta in batch:
                for out in delta.outputs:
                    number = index * plan.n + out.index
                    choice = choices[number]
                    text = _advance(plan, state, choice, index, delta, out)
                    # One chunk per generated token, even one that completes no character yet
                    # (as vLLM streams): clients time token arrivals by chunks.
                    if out.finish_reason is None and (plan.drop_output or not out.token_ids):
                        continue
                    item = {
                        "index": number,
                        "text": text,
                        "logprobs": choice.logprobs.take() if choice.logprobs else None,
                        "finish_reason": choice.finish_reason,
                        "stop_reason": choice.stop_reason,
                    }
                    if choice.prompt_logprobs is not None and not choice.prompt_logprobs_sent:
                        item["prompt_logprobs"] = choice.prompt_logprobs  # once, the first chunk
                        choice.prompt_logprobs_sent = True
                    chunks.append(frames.chunk(item))
            if chunks:
                yield b"".join(chunks)
        if plan.include_usage:
            yield sse({**_head(plan), "choices": [], "usage": _usage(plan, choices)})
        yield SSE_DONE
    except InvalidRequestError as exc:  # its grammar failed to compile after it was accepted
        yield sse(error_body(400, str(exc), exc.param, exc.code))
        yield SSE_DONE
    except Exception as exc:  # the engine died mid-stream: say so, then end the stream
        yield sse(error_body(503, f"generation failed: {exc}", code="engine_dead"))
        yield SSE_DONE
    finally:
        gen.close()
