"""`kiln serve`: the OpenAI-compatible HTTP server.

SIGTERM (or Ctrl-C) drains: new work gets 503, requests in flight get `--shutdown-grace` seconds
to finish (the rest are aborted), then the process exits 0. A second signal aborts what is
still running (each stream still ends with its last event and [DONE]) and exits. Before the
engine is ready, either signal stops the engine process and exits 128 + the signal (143, 130).

The engine (scheduler, executor, model) runs in its own process by default (kiln.engine_core):
this process's interpreter lock then serves HTTP, JSON and SSE only. `--no-engine-process` keeps
it on a thread of this process. If the engine process dies, /health turns 503, open streams end
with an error event, and the server exits 1 rather than serving nothing.

`--api-server-count N` runs N API processes over the one engine process (kiln.server.api_servers),
each with its own share of the connections; /metrics in any of them reports the whole server.
"""

from __future__ import annotations

import argparse
import signal
import threading
from typing import TYPE_CHECKING, Any, NoReturn

from kiln.cli.engine_args import add_engine_args, engine_config_from_args
from kiln.cli.vllm_flags import add_vllm_serve_flags, check_vllm_serve_flags
from kiln.envs import envs
from kiln.errors import ConfigError
from kiln.server.lora_modules import LoRAModule, parse_lora_modules
from kiln.server.reasoning import REASONING_PARSERS
from kiln.server.serving import DEFAULT_STALL_TIMEOUT_S, ServeOptions, serve_app
from kiln.server.tool_calls.parsers import PARSERS
from kiln.server.volatile_lines import DEFAULT_DROP_LINES

if TYPE_CHECKING:  # the engine's imports wait for the branch that needs them
    from kiln.server.state import ServedEngine

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    _add_http_args(p)
    _add_process_args(p)
    p.add_argument("model_tag", nargs="?", default=None, help="the model, as vLLM takes it")
    add_vllm_serve_flags(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def _add_http_args(p: argparse.ArgumentParser) -> None:
    """Where and how the server listens, guards, limits and reports."""
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--grpc-port",
        type=int,
        default=None,
        help="also serve KServe v2 / Triton's gRPC protocol on this port (Triton's is 8001)",
    )
    p.add_argument(
        "--api-key",
        default=envs().api_key,
        help="guards every route but /health and /metrics (default: $KILN_API_KEY)",
    )
    p.add_argument(
        "--metrics-api-key",
        default=None,
        help="a key for /metrics (default: open, as vLLM's, so a Prometheus scrape set up for "
        "vLLM works)",
    )
    p.add_argument("--served-model-name", default=None, help="default: --model as given")
    p.add_argument(
        "--max-waiting",
        type=int,
        default=1024,
        help="requests queued beyond this get 503 (per API process)",
    )
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection has to send its request headers before it is closed",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open connections beyond this are closed at once; the last --health-reserve of "
        "them serve /health only (default: the descriptor limit less 256; per API process)",
    )
    p.add_argument("--health-reserve", type=int, default=8, help="see --max-connections")
    p.add_argument(
        "--shutdown-grace", type=float, default=30.0, help="seconds in-flight requests get"
    )
    p.add_argument(
        "--metrics-prefix",
        default="kiln",
        choices=["kiln", "vllm", "both"],
        help="/metrics names: kiln:*, vllm:* (vLLM's dashboards work as they are), or both",
    )
    p.add_argument(
        "--log-level",
        "--uvicorn-log-level",  # vLLM's name
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
    )
    p.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        help="output limit of a request that names no max_tokens (default: up to the context, "
        "as vLLM; a cap keeps a forgetful client from holding the engine for minutes)",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(PARSERS),
        default=None,
        help="the model's tool-call format for tool_choice auto (default: from its chat template)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=sorted(REASONING_PARSERS),
        default=None,
        help="split a reasoning model's <think> block off its replies (vLLM's names): "
        "reasoning_content in chat, reasoning items in Responses, thinking blocks in Messages",
    )
    p.add_argument(
        "--health-stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="seconds the engine may hold work without finishing a step before /health and "
        "KServe's ready answer 503 (0: never)",
    )
    p.add_argument(
        "--drop-prompt-lines",
        default=DEFAULT_DROP_LINES,
        metavar="REGEX",
        help="system-prompt lines that change every request and say nothing to the model, "
        "dropped so the prefix cache still serves the conversation; '' keeps them "
        "(default: Claude Code's billing header, %(default)r)",
    )
    p.add_argument(
        "--volatile-prompt-lines",
        default=None,
        metavar="REGEX",
        help="system-prompt lines that change every request (a timestamp), moved to the last "
        "user message so the prefix cache still serves the conversation before it",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility: tool_choice auto is always on",
    )


def _add_process_args(p: argparse.ArgumentParser) -> None:
    """How the server's processes and streams are laid out."""
    p.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the engine in its own process (default), or on a thread of the server's",
    )
    p.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        help="API processes (uvicorn + FastAPI each) over the one engine process (vLLM's name): "
        "one streams at most ~10k tok/s per core",
    )
    p.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="send a stream's tokens every N tokens in one frame (vLLM's name; the first token "
        "goes out at once): fewer frames per token when many streams run",
    )
    p.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="most sequences one request may ask for (prompts x n); more gets a 400",
    )


def run(args: argparse.Namespace) -> int:
    check_vllm_serve_flags(args)
    if args.stream_interval < 1:
        raise SystemExit(f"error: --stream-interval must be >= 1, got {args.stream_interval}")
    if args.api_server_count < 1:
        raise SystemExit(f"error: --api-server-count must be >= 1, got {args.api_server_count}")
    config = engine_config_from_args(args)
    options = serve_options(args)  # a malformed --lora-modules fails before the model loads
    if options.lora_modules and not config.enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora")
    if args.api_server_count > 1:
        if not args.engine_process:
            raise SystemExit("error: --api-server-count above 1 needs the engine process")
        from kiln.server.api_servers.launcher import run_api_servers

        return run_api_servers(options, config)
    engine: ServedEngine
    if args.engine_process:
        from kiln.engine_core.client import EngineClient, StartupCancelled

        with _StartupSignals() as signals:
            try:
                engine = EngineClient.start(
                    config, stream_interval=args.stream_interval, cancel=signals.received
                )
            except StartupCancelled:
                signals.leave()
        if signals.received.is_set():  # came after the start's last look
            engine.shutdown(timeout=1.0)
            signals.leave()
    else:
        from kiln.engine.async_engine import AsyncEngine

        engine = AsyncEngine.from_config(config, stream_interval=args.stream_interval)
    return serve_app(options, engine, grpc_port=args.grpc_port)


class _StartupSignals:
    """SIGTERM or SIGINT while the engine starts is noted in `received`, which the start looks
    at between its steps: it stops its engine process, then `leave()` exits with 128 + the
    signal. The server's own drain takes the signals over once it runs. Not raised from the
    handler: raised wherever the main thread was, the exception landed inside pyzmq between a
    socket's making and its registration with its context, whose term() then waited forever
    for that socket (the server hung instead of stopping)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.received = threading.Event()
        self.signum = 0
        self._previous: dict[int, Any] = {}

    def _note(self, signum: int, frame: object) -> None:
        self.signum = self.signum or signum  # the first one says why
        self.received.set()

    def __enter__(self) -> _StartupSignals:
        self._previous = {s: signal.signal(s, self._note) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def leave(self) -> NoReturn:
        raise SystemExit(128 + self.signum)


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """The server's settings from `kiln serve`'s flags."""
    model_name = args.served_model_name or args.model or DEFAULT_MODEL_NAME
    lora_modules: tuple[LoRAModule, ...] = parse_lora_modules(args.lora_modules, model_name)
    return ServeOptions(
        model_name=model_name,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=args.api_key,
        metrics_api_key=args.metrics_api_key,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        shutdown_grace=args.shutdown_grace,
        metrics_prefix=args.metrics_prefix,
        log_level=args.log_level,
        max_tokens_default=args.max_tokens_default,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        stall_timeout_s=args.health_stall_timeout,
        drop_prompt_lines=args.drop_prompt_lines,
        volatile_prompt_lines=args.volatile_prompt_lines,
        max_seqs_per_request=args.max_seqs_per_request,
        access_log=args.enable_log_requests,
        stream_interval=args.stream_interval,
        api_server_count=args.api_server_count,
        header_timeout_s=args.header_timeout,
        max_connections=args.max_connections,
        health_reserve=args.health_reserve,
        lora_modules=lora_modules,
    )
