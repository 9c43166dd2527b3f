"""The small endpoints: /v1/models, /health, /version, /metrics, /tokenize, /detokenize,
/tokenizer_info."""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

import kiln
from kiln.errors import InvalidRequestError
from kiln.server.chat import chat_prompt_ids
from kiln.server.errors import error_response
from kiln.server.metrics import CONTENT_TYPE
from kiln.server.protocol import ERROR_RESPONSES, DetokenizeRequest, TokenizeRequest
from kiln.server.state import ServerState, State, off_the_loop

router = APIRouter()


def _model_card(state: ServerState) -> dict:
    return {
        "id": state.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kiln",
        "root": state.model_name,
        "max_model_len": state.max_model_len,
        "vocab_size": state.vocab_size,  # lets a load generator draw valid random token ids
    }


@router.get("/v1/models", responses=ERROR_RESPONSES)
async def list_models(state: State) -> dict:
    """The base model, then each LoRA adapter (its `parent` the base, as vLLM lists them)."""
    return {"object": "list", "data": [_model_card(state), *_adapter_cards(state)]}


def _adapter_cards(state: ServerState) -> list[dict]:
    return [] if state.adapters is None else state.adapters.cards(state.max_model_len)


@router.get("/v1/models/{model_id:path}", responses=ERROR_RESPONSES)
async def retrieve_model(model_id: str, state: State) -> dict:
    """The openai SDK's models.retrieve; ids may contain slashes (hub-style names)."""
    lora = state.check_model(model_id)
    if lora is None:
        return _model_card(state)
    return next(card for card in _adapter_cards(state) if card["id"] == lora.lora_name)


@router.get("/tokenizer_info", responses=ERROR_RESPONSES)
async def tokenizer_info(state: State) -> dict:
    """The tokenizer's special tokens, chat template and limits, as vLLM serves them:
    lm-evaluation-harness's remote tokenizer reads eos/bos/pad and the chat template here."""
    tokenizer = state.require_tokenizer("model")
    special = {
        name: getattr(tokenizer, name, None)
        for name in ("eos_token", "bos_token", "pad_token", "unk_token")
    }
    return {
        "tokenizer_class": type(tokenizer).__name__,
        **special,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "model_max_length": state.max_model_len,
        "add_bos_token": getattr(tokenizer, "add_bos_token", None),
    }


@router.get("/health", responses=ERROR_RESPONSES)
async def health(state: State) -> Response:
    """200 while the engine loop runs, makes progress and the server accepts work; 503 (with
    the reason) otherwise."""
    if not state.engine.healthy:
        message = f"engine loop is dead: {state.engine.error!r}"
        return error_response(503, message, code="engine_dead")
    if state.lifecycle.draining:
        return error_response(503, "the server is shutting down", code="shutting_down")
    stalled = state.stall.reason() if state.stall is not None else None
    if stalled is not None:
        return error_response(503, stalled, code="engine_stalled")
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict:
    return {"version": kiln.__version__}


@router.get("/metrics", response_class=Response, responses=ERROR_RESPONSES)
async def metrics(state: State) -> Response:
    body = await state.metrics.render(state.engine)
    return Response(body, media_type=CONTENT_TYPE)


@router.post("/tokenize", responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, state: State) -> JSONResponse:
    state.check_model(body.model)
    add_generation_prompt = body.add_generation_prompt is not False
    if body.messages is not None and body.prompt is None:  # off the loop, as for generation
        ids = await run_in_threadpool(chat_prompt_ids, state, body.messages, add_generation_prompt)
    elif body.prompt is not None and body.messages is None:
        special = body.add_special_tokens is not False
        ids = await off_the_loop(len(body.prompt), state.tokenize, body.prompt, special)
    else:
        raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len})


@router.post("/detokenize", responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, state: State) -> JSONResponse:
    state.check_model(body.model)
    return JSONResponse({"prompt": state.detokenize(body.tokens)})


# OpenAI routes kiln does not serve, refused in one line that says why rather than a bare 404
# (an openai SDK's embeddings.create used to read "Not Found").
_UNSERVED = {
    "/v1/embeddings": "kiln serves generation only: no embeddings (vLLM's --task embed)",
    "/v1/audio/transcriptions": "kiln serves no audio models",
}


def _refusal(path: str, why: str):  # one closure per route: FastAPI takes a plain function
    async def refuse() -> Response:
        return error_response(404, f"{path} is not served: {why}", code="not_supported")

    return refuse


for _path, _why in _UNSERVED.items():
    router.add_api_route(_path, _refusal(_path, _why), methods=["POST"], include_in_schema=False)
