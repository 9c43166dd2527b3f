"""What every HTTP request passes before routing: the API key, the body size limit, then valid
Unicode in every string of an OpenAI route's body (kiln.server.text_check).

Pure ASGI (no BaseHTTPMiddleware), so streaming responses and disconnect messages pass through
untouched. The body is read here, up to the limit, and replayed to the app; after the replay the
app's `receive` is the server's again, so disconnects still reach the handlers.
"""

from __future__ import annotations

import hmac
import json

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kiln.server.errors import error_body, shaped_body
from kiln.server.text_check import check_json_body, may_hold_surrogates

OPEN_PATHS = frozenset({"/health"})  # load balancers probe it without credentials
# Open unless --metrics-api-key: vLLM guards only /v1/*, so a Prometheus scrape set up for vLLM
# sends no key. Every other route (tokenize, version, ...) stays behind --api-key.
METRICS_PATH = "/metrics"
_DISCARD_LIMIT = 64 << 20


class GuardMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body_bytes: int,
        metrics_api_key: str | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.metrics_api_key = metrics_api_key.encode() if metrics_api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        path = scope["path"]
        key = (
            self.metrics_api_key
            if path == METRICS_PATH
            else None
            if path in OPEN_PATHS
            else self.api_key
        )
        if key is not None and not self._authorized(headers, key):
            reason = "invalid or missing API key (Authorization: Bearer <key>, or x-api-key)"
            await _reply(send, 401, reason, "invalid_api_key", path)
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body_bytes):
            await self._refuse_body(receive, send, path=path)
            return
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:  # a chunked body has no Content-Length to check
                more = message.get("more_body", False)
                await self._refuse_body(receive, send, more=more, path=path)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        if not path.startswith("/v2/") and may_hold_surrogates(body):  # KServe checks its own
            error = await run_in_threadpool(check_json_body, body)  # a walk of the whole body
            if error is not None:
                await _reply(send, 400, str(error), error.code, path, error.param)
                return
        await self.app(scope, _replay(body, receive), send)

    def _authorized(self, headers: dict[bytes, bytes], key: bytes) -> bool:
        """Bearer (OpenAI's clients) or x-api-key (Anthropic's)."""
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        # compare_digest takes as long for a wrong key as for a right one: no timing oracle.
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
            return True
        return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), key)

    async def _refuse_body(
        self, receive: Receive, send: Send, more: bool = True, path: str = ""
    ) -> None:
        """413. A client still sending would see a reset instead of our answer, so read (and
        drop) a bounded amount of what it sends first; past that, it gets the reset."""
        budget = _DISCARD_LIMIT
        while more and budget > 0:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            budget -= len(message.get("body", b""))
            more = message.get("more_body", False)
        reason = f"request body is larger than the limit of {self.max_body_bytes} bytes"
        await _reply(send, 413, reason, "request_too_large", path)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _reply(
    send: Send, status: int, message: str, code: str | None, path: str, param: str | None = None
) -> None:
    body = json.dumps(shaped_body(path, status, error_body(status, message, param, code))).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
