"""What every handler needs: the engine, the model's facts, the books (lifecycle, metrics)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Protocol, TypeAlias, TypeVar

from fastapi import Depends
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from kiln.engine.async_engine import AsyncEngine
from kiln.engine_core.client import EngineClient
from kiln.errors import InvalidRequestError
from kiln.sampling_params import SamplingParams
from kiln.server.errors import APIError
from kiln.server.lifecycle import Lifecycle
from kiln.server.metrics import ServerMetrics
from kiln.server.volatile_lines import PromptLineRules
from kiln.tokenizer import Tokenizer

if TYPE_CHECKING:  # the adapters' module imports this one
    from kiln.lora.request import LoRARequest
    from kiln.server.lora import LoRAAdapters

T = TypeVar("T")


class StallCheck(Protocol):
    def reason(self) -> str | None: ...


# The engine the server drives: the engine thread, or the engine process's client (same surface).
ServedEngine: TypeAlias = AsyncEngine | EngineClient


@dataclass
class ServerState:
    engine: ServedEngine
    model_name: str
    lifecycle: Lifecycle
    metrics: ServerMetrics
    max_tokens_default: int | None = None  # for requests that name no max_tokens
    tool_call_parser: str | None = None  # None: chosen from the model's chat template
    reasoning_parser: str | None = None  # None: replies are content (no reasoning split)
    stall: StallCheck | None = None  # the engine's progress (kiln.server.stall), None: unwatched
    prompt_lines: PromptLineRules | None = None  # volatile system lines dropped or moved
    adapters: LoRAAdapters | None = None  # LoRA adapters by name; None: --enable-lora is off

    def __post_init__(self) -> None:
        # Read once: immutable after the engine is built, so safe from the event-loop thread.
        info = self.engine.info
        self.tokenizer = self.engine.tokenizer
        self.max_model_len: int = info.max_model_len
        self.vocab_size: int = info.vocab_size
        self.defaults: SamplingParams = info.default_params
        # Bounds that reject an over-long prompt from its size alone, before the tokenizer or
        # the chat template spends seconds (and gigabytes) on it: measured on first need (the
        # vocabulary walk takes ~0.5 s, and only text longer than the context needs it):
        # the most characters one token stands for, the fewest tokens a chat message costs.
        self._size_bounds: tuple[int, int] | None = None

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names, None for the base model (or no name);
        any other name is OpenAI's 404."""
        if model:
            check_text(model, "model")
        if not model or model == self.model_name:
            return None
        lora = self.adapters.get(model) if self.adapters is not None else None
        if lora is None:
            served = ", ".join(f"`{n}`" for n in self.served_names())
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves {served}",
                param="model",
                code="model_not_found",
            )
        return lora

    def served_names(self) -> list[str]:
        """The base model's name, then the adapters'."""
        return [self.model_name, *(self.adapters.names() if self.adapters is not None else [])]

    def response_model(self, lora: LoRARequest | None) -> str:
        """The `model` a response names: the adapter asked for, else the base model."""
        return self.model_name if lora is None else lora.lora_name

    def require_tokenizer(self, param: str) -> Tokenizer:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer: send token ids instead", param=param
            )
        return self.tokenizer

    def check_prompt_size(self, num_chars: int, param: str, num_messages: int = 0) -> None:
        """400 if text of `num_chars` characters (in `num_messages` chat messages) cannot fit the
        context whatever it says: each token is at most `max_chars_per_token` characters, each
        message costs the template's markup. O(1): the tokenizer never sees such a prompt."""
        if num_chars + num_messages <= self.max_model_len:
            return  # this short, tokenizing is quick and says exactly: no bound needed
        if self._size_bounds is None:
            self._size_bounds = (
                _longest_token_chars(self.tokenizer) or 0,
                _min_tokens_per_message(self.tokenizer),
            )
        max_chars_per_token, min_tokens_per_message = self._size_bounds
        if not max_chars_per_token:
            return
        at_least = -(-num_chars // max_chars_per_token)
        at_least += num_messages * min_tokens_per_message
        if at_least > self.max_model_len:
            raise InvalidRequestError(
                f"{param} is at least {at_least} tokens long ({num_chars} characters"
                + (f" in {num_messages} messages" if num_messages else "")
                + f"), more than this model's context of {self.max_model_len} tokens",
                param=param,
                code="context_length_exceeded",
            )

    def check_messages(self, contents: list[str], num_chars: int | None = None) -> None:
        """Chat contents: valid Unicode, and not over the context by their size alone
        (`num_chars`: every character the request gives the template, tools and tool-call
        arguments included; default the contents')."""
        for content in contents:
            check_text(content, "messages")
        total = sum(map(len, contents)) if num_chars is None else num_chars
        self.check_prompt_size(total, "messages", len(contents))

    def tokenize(
        self, text: str, add_special_tokens: bool = True, param: str = "prompt"
    ) -> list[int]:
        """The same ids the offline API would use for this text."""
        tokenizer = self.require_tokenizer(param)
        check_text(text, param)
        self.check_prompt_size(len(text), param)
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def detokenize(self, token_ids: list[int], param: str = "tokens") -> str:
        tokenizer = self.require_tokenizer(param)
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", param=param
            )
        return tokenizer.decode(token_ids)

    @staticmethod
    def new_id(prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex}"


# Text beyond this many characters is tokenized (or templated) on a worker thread; below it,
# inline: a hop to the thread pool (and its capacity limiter, under a burst of hundreds of
# requests) costs more than tokenizing a short prompt, and token-id prompts need neither.
OFFLOAD_CHARS = 4096


async def off_the_loop(num_chars: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args), on a worker thread if the text it works on is long enough to stall the event
    loop (every open stream and /health wait while it holds the loop)."""
    if num_chars <= OFFLOAD_CHARS:
        return fn(*args)
    return await run_in_threadpool(fn, *args)


def text_size(value: object) -> int:
    """Characters of text anywhere in a request value: strings, dict keys and values, lists,
    pydantic models' fields (a chat message's content, name, tool calls and their arguments;
    tools). Token ids count nothing. Iterative: a deeply nested value cannot overflow the stack."""
    total, stack = 0, [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        elif isinstance(item, BaseModel):
            stack.extend(item.__dict__.values())
    return total


def check_text(text: str, param: str) -> None:
    """A lone surrogate (JSON allows "\\ud800") is no Unicode text: the tokenizer would fail
    with a 500. A 400 naming the field instead."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} is not valid Unicode: a lone surrogate at character {exc.start}",
            param=param,
        ) from None


def _longest_token_chars(tokenizer: Tokenizer | None) -> int | None:
    """The most characters one token can stand for: the longest vocabulary entry (byte-level
    BPE writes one character per byte, SentencePiece one per character), special tokens
    included. None when unknown (no tokenizer, no vocabulary): no size bound then."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        longest = max((len(piece) for piece in get_vocab()), default=0)
    except Exception:
        return None
    return longest or None


def _min_tokens_per_message(tokenizer: Tokenizer | None) -> int:
    """The template's markup per chat message, measured once (an empty assistant turn); at
    least 1. A template that renders nothing for it counts 1."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return 1
    try:
        one = [{"role": "user", "content": ""}]
        two = [*one, {"role": "assistant", "content": ""}]
        render = tokenizer.apply_chat_template
        a = render(one, tokenize=False, add_generation_prompt=False)
        b = render(two, tokenize=False, add_generation_prompt=False)
        extra = len(tokenizer.encode(b, add_special_tokens=False)) - len(
            tokenizer.encode(a, add_special_tokens=False)
        )
    except Exception:
        return 1
    return max(1, extra)


def get_state(request: Request) -> ServerState:
    return request.app.state.kiln


async def _state_dependency(request: Request) -> ServerState:
    # A coroutine: FastAPI runs a plain-function dependency on its thread pool, a thread hop per
    # request (~2% of the API process's CPU in a streaming profile) for one attribute read.
    return request.app.state.kiln


State = Annotated[ServerState, Depends(_state_dependency)]
