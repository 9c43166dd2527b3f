"""Every failure leaves the server as an OpenAI error object:
`{"error": {"message", "type", "param", "code"}}`, which the openai client turns into its own
exception classes. Validation failures are 400 (as OpenAI answers), never FastAPI's 422."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.engine.async_engine import EngineDeadError
from kiln.errors import InvalidRequestError, LoRAError

logger = logging.getLogger("kiln.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error with its HTTP status, raised anywhere in a handler."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status)


ErrorShape = Callable[[int, dict], dict]
ERROR_SHAPES: dict[str, ErrorShape] = {}
"""Path prefix -> how its errors look, for routes of a protocol that is not OpenAI's (Anthropic's
Messages API): the OpenAI error body in, that protocol's body out."""


def shaped_body(path: str, status: int, body: dict) -> dict:
    for prefix, shape in ERROR_SHAPES.items():
        if path.startswith(prefix):
            return shape(status, body)
    return body


def _shaped(handler: Callable[[Request, Any], Awaitable[JSONResponse]]):
    async def run(request: Request, exc: Any) -> JSONResponse:
        response = await handler(request, exc)
        path = request.url.path
        if not any(path.startswith(prefix) for prefix in ERROR_SHAPES):
            return response
        body = shaped_body(path, response.status_code, json.loads(bytes(response.body)))
        shaped = JSONResponse(body, status_code=response.status_code)
        for name in ("allow", "www-authenticate"):
            if name in response.headers:
                shaped.headers[name] = response.headers[name]
        return shaped

    return run


def _validation_param(loc: tuple) -> str | None:
    # ("body", "messages", 0, "content") -> "messages": the top-level field a client can fix.
    fields = [p for p in loc[1:] if isinstance(p, str)]
    return fields[0] if fields else None


def _most_specific(errors: list[dict]) -> dict:
    """The error a client can act on. A union (prompt: str | list[int] | ...) reports one error
    per member; a violated bound (a negative token id) says more than "should be a valid
    string", and the deepest location more than the shallowest."""

    def rank(error: dict) -> tuple[bool, int]:
        kind = str(error.get("type", ""))
        mismatch = kind.endswith(("_type", "_parsing")) or kind in ("missing", "union_tag_invalid")
        return (mismatch, -len(error.get("loc", ())))

    return min(errors, key=rank)


async def _on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if not errors:
        return error_response(400, "invalid request body")
    first = _most_specific(list(errors))
    param = _validation_param(tuple(first.get("loc", ())))
    where = f"{param}: " if param else ""
    message = f"{where}{first.get('msg', 'invalid value')}"
    if "input" in first and not isinstance(first["input"], (dict, list)):
        message += f", got {first['input']!r}"[:200]
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more problems)"
    return error_response(400, message, param)


async def _on_api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.code)


async def _on_invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
    return error_response(400, str(exc), exc.param, exc.code)


async def _on_lora(_: Request, exc: LoRAError) -> JSONResponse:
    # An adapter the engine could not (re)load for a request: its files changed or went away.
    return error_response(400, str(exc), "model", "invalid_lora")


async def _on_engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(503, str(exc), code="engine_dead")


async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    response = error_response(exc.status_code, str(exc.detail))
    for name, value in (exc.headers or {}).items():  # 405's Allow, 401's WWW-Authenticate
        response.headers[name] = value
    return response


async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=exc)
    return error_response(500, f"internal error: {type(exc).__name__}")


def install_error_handlers(app: FastAPI) -> None:
    # Starlette calls each handler only with the class it is registered for; `_shaped` takes
    # any exception, as Starlette's ExceptionHandler alias does.
    app.add_exception_handler(RequestValidationError, _shaped(_on_validation))
    app.add_exception_handler(APIError, _shaped(_on_api_error))
    app.add_exception_handler(InvalidRequestError, _shaped(_on_invalid_request))
    app.add_exception_handler(LoRAError, _shaped(_on_lora))
    app.add_exception_handler(EngineDeadError, _shaped(_on_engine_dead))
    app.add_exception_handler(StarletteHTTPException, _shaped(_on_http))
    app.add_exception_handler(Exception, _shaped(_on_unexpected))
