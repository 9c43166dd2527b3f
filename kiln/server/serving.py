"""Run the HTTP app over an engine until it drains or the engine dies: what `kiln serve` and each
API process of `--api-server-count N` do once their engine is attached."""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.errors import ConfigError
from kiln.server.lora_modules import LoRAModule
from kiln.server.volatile_lines import DEFAULT_DROP_LINES

if TYPE_CHECKING:  # the engine's and the app's imports wait until serve_app runs
    from kiln.server.state import ServedEngine

DEFAULT_STALL_TIMEOUT_S = 120.0  # above any one step (a long prefill, a first-step compile)


@dataclass(frozen=True)
class ServeOptions:
    """The server's own settings (`kiln serve`'s flags that are not the engine's), plain values
    so a spawned API process can receive them."""

    model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int | None = None
    api_key: str | None = None
    metrics_api_key: str | None = None
    max_waiting: int = 1024
    max_body_bytes: int = 16 << 20
    shutdown_grace: float = 30.0
    metrics_prefix: str = "kiln"
    log_level: str = "info"
    max_tokens_default: int | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S
    drop_prompt_lines: str | None = DEFAULT_DROP_LINES
    volatile_prompt_lines: str | None = None
    max_seqs_per_request: int = 256
    access_log: bool = False
    stream_interval: int = 1
    api_server_count: int = 1
    header_timeout_s: float = 10.0
    max_connections: int | None = None  # None: from the descriptor limit
    health_reserve: int = 8
    lora_modules: tuple[LoRAModule, ...] = ()  # adapters served from the start (--lora-modules)

    def __post_init__(self) -> None:
        if self.header_timeout_s <= 0:
            raise ConfigError(f"--header-timeout must be > 0, got {self.header_timeout_s}")
        if self.max_connections is not None and self.max_connections <= self.health_reserve:
            raise ConfigError(
                f"--max-connections must be above --health-reserve ({self.health_reserve}), "
                f"got {self.max_connections}"
            )
        if self.health_reserve < 0:
            raise ConfigError(f"--health-reserve must be >= 0, got {self.health_reserve}")


def serve_app(
    options: ServeOptions,
    engine: ServedEngine,
    sockets: list[socket.socket] | None = None,
    grpc_port: int | None = None,
    metrics_dir: str | None = None,
    responses_db: str | None = None,
) -> int:
    """Serve the app over `engine` (on `sockets`, else options.host/port) until the drain or the
    engine's death; shuts the engine down. kiln serve's exit status. `metrics_dir` and
    `responses_db`: what several API processes share (kiln.server.api_servers)."""
    import asyncio

    import uvicorn

    from kiln.server.app import build_app
    from kiln.server.connections import guarded_protocol
    from kiln.server.lifecycle import DrainingServer

    app = build_app(
        engine,
        options.model_name,
        api_key=options.api_key,
        max_waiting=options.max_waiting,
        max_body_bytes=options.max_body_bytes,
        metrics_prefix=options.metrics_prefix,
        grpc_port=grpc_port,
        grpc_host=options.host,
        max_tokens_default=options.max_tokens_default,
        tool_call_parser=options.tool_call_parser,
        reasoning_parser=options.reasoning_parser,
        stall_timeout_s=options.stall_timeout_s,
        drop_prompt_lines=options.drop_prompt_lines,
        volatile_prompt_lines=options.volatile_prompt_lines,
        max_seqs_per_request=options.max_seqs_per_request,
        metrics_api_key=options.metrics_api_key,
        metrics_multiprocess_dir=metrics_dir,
        responses_store_path=responses_db,
        lora_runtime_updates=options.api_server_count == 1,
    )
    uv_config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        log_level=options.log_level,
        timeout_graceful_shutdown=5,
        lifespan="off" if grpc_port is None else "on",  # the lifespan serves gRPC
        # One log line per request costs the event loop under load: off unless asked for.
        access_log=options.access_log,
        http=guarded_protocol(
            options.header_timeout_s, options.max_connections, options.health_reserve
        ),
    )
    state = app.state.kiln
    server = DrainingServer(
        uv_config,
        lambda: state.lifecycle.drain(options.shutdown_grace, state.engine.abort),
        abort_all=lambda: state.lifecycle.abort_all(state.engine.abort),
    )
    engine.on_dead = server.engine_died
    try:
        if options.lora_modules:
            from kiln.server.lora import load_modules

            asyncio.run(load_modules(state, options.lora_modules))
        server.run(sockets=sockets)
    finally:
        engine.shutdown()
    return 1 if server.engine_dead else 0
