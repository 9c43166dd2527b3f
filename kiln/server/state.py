"""What every handler needs: the engine, the model's facts, the books (lifecycle, metrics)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends
from starlette.requests import Request

from kiln.engine.async_engine import AsyncEngine
from kiln.errors import InvalidRequestError
from kiln.sampling_params import SamplingParams
from kiln.server.errors import APIError
from kiln.server.lifecycle import Lifecycle
from kiln.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    model_name: str
    lifecycle: Lifecycle
    metrics: ServerMetrics
    max_tokens_default: int | None = None  # for requests that name no max_tokens
    tool_call_parser: str | None = None  # None: chosen from the model's chat template

    def __post_init__(self) -> None:
        # Read once: immutable after the engine is built, so safe from the event-loop thread.
        core = self.engine.engine
        self.tokenizer = core.tokenizer
        self.max_model_len: int = core.max_model_len
        self.vocab_size: int = core.model_config.vocab_size
        self.defaults: SamplingParams = core.default_sampling_params()

    def check_model(self, model: str | None) -> None:
        if model and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                param="model",
                code="model_not_found",
            )

    def require_tokenizer(self, param: str) -> object:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer: send token ids instead", param=param
            )
        return self.tokenizer

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The same ids the offline API would use for this text."""
        tokenizer = self.require_tokenizer("prompt")
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


def get_state(request: Request) -> ServerState:
    return request.app.state.kiln


State = Annotated[ServerState, Depends(get_state)]
