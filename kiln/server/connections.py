"""What a connection may hold before it is a request: a header-read deadline, and a cap on open
connections with a reserve that only /health may use.

uvicorn closes an idle keep-alive connection, but a client that sends its headers a byte at a
time (or never) holds a descriptor forever, and nothing stops connections beyond the process's
descriptor limit: then no one, /health included, can connect. This protocol (uvicorn's httptools
one, passed as `uvicorn.Config(http=...)`) closes a connection whose request headers are not
complete `header_timeout_s` after its first byte (or after it opened), refuses connections beyond
`max_connections` by closing them at once, and serves the last `health_reserve` of them /health
only (any other path: 503), so a load balancer still sees the server while clients wait.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from typing import Any, ClassVar

from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kiln.server.errors import error_body

logger = logging.getLogger("kiln.server")

DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_HEALTH_RESERVE = 8
# Descriptors left for the process itself (model files, the engine's sockets, logs) when the
# connection cap is derived from the descriptor limit.
_FD_MARGIN = 256
_LOG_EVERY_S = 10.0


def default_max_connections() -> int:
    """The cap when none is given: what the descriptor limit leaves after the process's own."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 65536
    return max(2 * DEFAULT_HEALTH_RESERVE, soft - _FD_MARGIN)


def guarded_protocol(
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    max_connections: int | None = None,
    health_reserve: int = DEFAULT_HEALTH_RESERVE,
) -> type[HttpToolsProtocol]:
    """uvicorn's HTTP protocol with these limits (a class: uvicorn builds one per connection)."""
    if header_timeout_s <= 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    cap = default_max_connections() if max_connections is None else max_connections
    if cap < 1 or not 0 <= health_reserve < cap:
        raise ValueError(
            f"max_connections must be >= 1 and above health_reserve, got {cap} and {health_reserve}"
        )

    class Guarded(GuardedProtocol):
        pass

    Guarded.header_timeout_s = header_timeout_s
    Guarded.max_connections = cap
    Guarded.health_reserve = health_reserve
    return Guarded


class GuardedProtocol(HttpToolsProtocol):
    header_timeout_s: ClassVar[float] = DEFAULT_HEADER_TIMEOUT_S
    max_connections: ClassVar[int] = 1024
    health_reserve: ClassVar[int] = DEFAULT_HEALTH_RESERVE
    _last_log: ClassVar[float] = 0.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        num_open = len(self.connections)
        if num_open > self.max_connections:
            self._log(f"{num_open - 1} connections open (the cap): a new one is closed")
            transport.abort()
            return
        if num_open > self.max_connections - self.health_reserve:
            self.app = _health_only(self.app)
        self._arm_header_deadline()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_deadline()  # the next request of a keep-alive connection

    def on_headers_complete(self) -> None:
        self._cancel_header_deadline()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is None:
            self._header_deadline = self.loop.call_later(
                self.header_timeout_s, self._header_timed_out
            )

    def _cancel_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _header_timed_out(self) -> None:
        self._header_deadline = None
        self._log(f"request headers not complete in {self.header_timeout_s:g} s: closed")
        self.transport.abort()

    @classmethod
    def _log(cls, message: str) -> None:
        # At most one line per interval: a flood of connections must not become a flood of logs.
        now = time.monotonic()
        if now - cls._last_log >= _LOG_EVERY_S:
            GuardedProtocol._last_log = now
            logger.warning("connection guard: %s", message)


def _health_only(app: ASGIApp) -> ASGIApp:
    """`app` for /health; 503 for anything else (a connection in the reserve)."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            await app(scope, receive, send)
            return
        body = json.dumps(
            error_body(503, "too many open connections: retry later", code="overloaded")
        ).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    return guarded
