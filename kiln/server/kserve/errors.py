"""The protocol's errors: one status, shown as an HTTP code (`{"error": message}`, KServe v2's
error object) or a gRPC status code. Every failure of a KServe route or RPC becomes one of these,
so a client never sees the OpenAI error shape or a traceback."""

from __future__ import annotations

import enum
import logging

import grpc

from kiln.engine.async_engine import EngineDeadError
from kiln.errors import InvalidRequestError
from kiln.server.errors import APIError

logger = logging.getLogger("kiln.server.kserve")


class Status(enum.Enum):
    # (HTTP status, gRPC code), as Triton maps its TRITONSERVER_Error codes.
    INVALID_ARGUMENT = (400, grpc.StatusCode.INVALID_ARGUMENT)
    UNAUTHENTICATED = (401, grpc.StatusCode.UNAUTHENTICATED)
    NOT_FOUND = (404, grpc.StatusCode.NOT_FOUND)
    UNAVAILABLE = (503, grpc.StatusCode.UNAVAILABLE)
    INTERNAL = (500, grpc.StatusCode.INTERNAL)

    @property
    def http(self) -> int:
        return self.value[0]

    @property
    def grpc(self) -> grpc.StatusCode:
        return self.value[1]


class KServeError(Exception):
    def __init__(self, message: str, status: Status = Status.INVALID_ARGUMENT) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


def invalid(message: str) -> KServeError:
    return KServeError(message, Status.INVALID_ARGUMENT)


def as_kserve_error(exc: BaseException) -> KServeError:
    """Any exception a handler meets, as the protocol's error (unexpected ones are logged)."""
    if isinstance(exc, KServeError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return KServeError(str(exc), Status.INVALID_ARGUMENT)
    if isinstance(exc, EngineDeadError):
        return KServeError(str(exc), Status.UNAVAILABLE)
    if isinstance(exc, APIError):  # admission (503 overloaded / draining), from the shared core
        status = {400: Status.INVALID_ARGUMENT, 404: Status.NOT_FOUND, 503: Status.UNAVAILABLE}
        return KServeError(exc.message, status.get(exc.status, Status.INTERNAL))
    logger.error("unhandled error in a KServe handler", exc_info=exc)
    return KServeError(f"internal error: {type(exc).__name__}", Status.INTERNAL)
