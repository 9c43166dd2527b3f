"""`kiln serve`: the OpenAI-compatible HTTP server.

SIGTERM (or Ctrl-C) drains: new work gets 503, requests in flight get `--shutdown-grace` seconds
to finish (the rest are aborted), then the process exits 0. A second signal exits at once.
"""

from __future__ import annotations

import argparse

from kiln.cli.engine_args import add_engine_args, engine_config_from_args
from kiln.cli.vllm_flags import add_vllm_serve_flags, check_vllm_serve_flags
from kiln.envs import envs

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
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
        "--max-waiting", type=int, default=1024, help="requests queued beyond this get 503"
    )
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="larger bodies get 413")
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
    p.add_argument("model_tag", nargs="?", default=None, help="the model, as vLLM takes it")
    add_vllm_serve_flags(p)
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from kiln.engine.async_engine import AsyncEngine
    from kiln.server.app import build_app
    from kiln.server.lifecycle import DrainingServer

    check_vllm_serve_flags(args)
    engine = AsyncEngine.from_config(engine_config_from_args(args))
    app = build_app(
        engine,
        args.served_model_name or args.model or DEFAULT_MODEL_NAME,
        api_key=args.api_key,
        max_waiting=args.max_waiting,
        max_body_bytes=args.max_body_bytes,
        metrics_prefix=args.metrics_prefix,
        max_tokens_default=args.max_tokens_default,
        metrics_api_key=args.metrics_api_key,
    )
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=5,
        lifespan="off",
        # One log line per request costs the event loop under load: off unless asked for.
        access_log=args.enable_log_requests,
    )
    state = app.state.kiln
    server = DrainingServer(
        config, lambda: state.lifecycle.drain(args.shutdown_grace, state.engine.abort)
    )
    try:
        server.run()
    finally:
        engine.shutdown()
    return 0
