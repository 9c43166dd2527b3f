"""The connection guard (kiln.server.connections): a client that never finishes its headers is
closed after the header timeout, and connections beyond the cap are refused while a reserve
still answers /health (issue 57: slow clients exhausted the descriptors)."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from kiln.errors import ConfigError
from kiln.server.connections import guarded_protocol
from kiln.server.serving import ServeOptions


async def _app(scope, receive, send) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


class _Server:
    def __init__(self, **limits: object) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(
            _app, log_level="error", lifespan="off", http=guarded_protocol(**limits)
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    def __enter__(self) -> _Server:
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(10)

    def connect(self) -> socket.socket:
        conn = socket.create_connection(("127.0.0.1", self.port), timeout=5)
        conn.settimeout(5)
        return conn


def _get(conn: socket.socket, path: str) -> int:
    conn.sendall(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    head = conn.recv(4096)
    return int(head.split()[1]) if head else 0


def _closed(conn: socket.socket) -> bool:
    try:
        return conn.recv(1) == b""
    except (ConnectionResetError, TimeoutError):
        return True


def test_headers_never_finished_are_closed_after_the_timeout():
    with _Server(header_timeout_s=0.5, max_connections=64) as srv:
        slow, idle = srv.connect(), srv.connect()
        slow.sendall(b"GET /health HTTP/1.1\r\nHo")  # and nothing more
        t0 = time.monotonic()
        assert _closed(slow) and _closed(idle)  # before: held open forever
        assert time.monotonic() - t0 < 3.0
        with srv.connect() as ok:  # a client that sends its headers is served
            assert _get(ok, "/health") == 200
            time.sleep(0.8)  # past the timeout, between keep-alive requests: still served
            assert _get(ok, "/v1/models") == 200


def test_connections_over_the_cap_are_refused_and_the_reserve_serves_health():
    with _Server(header_timeout_s=30, max_connections=6, health_reserve=2) as srv:
        held = [srv.connect() for _ in range(4)]  # slow clients: headers never sent
        time.sleep(0.2)
        reserve = [srv.connect() for _ in range(2)]
        assert _get(reserve[0], "/health") == 200
        assert _get(reserve[1], "/v1/completions") == 503
        over = srv.connect()
        assert _closed(over)  # before: accepted and held, until descriptors ran out
        for conn in [*held, *reserve, over]:
            conn.close()
        time.sleep(0.2)
        with srv.connect() as again:  # the slots come back
            assert _get(again, "/v1/completions") == 200


@pytest.mark.parametrize(
    "options",
    [{"header_timeout_s": 0}, {"max_connections": 4, "health_reserve": 4}, {"health_reserve": -1}],
)
def test_bad_limits_are_config_errors(options):
    with pytest.raises(ConfigError):
        ServeOptions(model_name="m", **options)


def test_serve_flags_reach_the_options():
    import argparse

    from kiln.cli import serve

    parser = argparse.ArgumentParser()
    serve.add_parser(parser.add_subparsers())
    args = parser.parse_args(
        ["serve", "--header-timeout", "3", "--max-connections", "100", "--health-reserve", "4"]
    )
    options = serve.serve_options(args)
    assert (options.header_timeout_s, options.max_connections, options.health_reserve) == (
        3.0,
        100,
        4,
    )
