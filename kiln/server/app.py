"""The FastAPI app: routes, OpenAI error objects, auth and body limits, metrics, lifecycle.

The app does not own the engine: whoever built the AsyncEngine (the CLI, a test) shuts it down.
"""

from __future__ import annotations

from fastapi import FastAPI

import kiln
from kiln.server import chat, completions, kserve, lora, messages, responses, routes
from kiln.server.errors import install_error_handlers
from kiln.server.lifecycle import Lifecycle
from kiln.server.metrics import PREFIXES, ServerMetrics
from kiln.server.middleware import GuardMiddleware
from kiln.server.reasoning import REASONING_PARSERS
from kiln.server.responses import ResponseStore
from kiln.server.responses.store import DEFAULT_MAX_ENTRIES, IN_MEMORY
from kiln.server.serving import DEFAULT_STALL_TIMEOUT_S
from kiln.server.stall import StallWatch
from kiln.server.state import ServedEngine, ServerState
from kiln.server.tool_calls.parsers import PARSERS
from kiln.server.volatile_lines import DEFAULT_DROP_LINES, PromptLineRules

DEFAULT_MAX_WAITING = 1024
DEFAULT_MAX_BODY_BYTES = 16 << 20


def build_app(
    async_engine: ServedEngine,
    served_model_name: str,
    api_key: str | None = None,
    max_waiting: int = DEFAULT_MAX_WAITING,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics_prefix: str = "kiln",
    grpc_port: int | None = None,
    grpc_host: str = "127.0.0.1",
    max_tokens_default: int | None = None,
    tool_call_parser: str | None = None,
    max_seqs_per_request: int | None = None,
    metrics_api_key: str | None = None,
    metrics_multiprocess_dir: str | None = None,
    reasoning_parser: str | None = None,
    stall_timeout_s: float | None = DEFAULT_STALL_TIMEOUT_S,
    responses_store_size: int = DEFAULT_MAX_ENTRIES,
    responses_store_path: str | None = None,
    drop_prompt_lines: str | None = DEFAULT_DROP_LINES,
    volatile_prompt_lines: str | None = None,
    lora_runtime_updates: bool = True,
) -> FastAPI:
    """An OpenAI-compatible app over a running AsyncEngine. `app.state.kiln` holds the
    ServerState (its `lifecycle.drain` is what SIGTERM calls). `metrics_prefix`: "kiln",
    "vllm" (vLLM's dashboards work unchanged) or "both". `max_tokens_default`: the output limit
    of a request that names none (None: up to the context, as vLLM). `grpc_port`: also serve
    KServe v2 over gRPC there (0: any free port, then in `app.state.grpc_port`) while the app's
    lifespan runs. `max_seqs_per_request`: most sequences (prompts x n) one request may ask for
    (None: max_waiting); more is a 400. `api_key` guards every route but /health and /metrics;
    /metrics is open (as vLLM's) unless `metrics_api_key`. `metrics_multiprocess_dir`: the
    Prometheus multiprocess directory shared by several API processes (kiln.server.api_servers).
    `reasoning_parser`: split a reasoning model's `<think>` block off its replies (vLLM's names:
    "qwen3", "deepseek_r1"). `stall_timeout_s`: /health and KServe's ready turn 503 once the
    engine holds work and has made no step for this long (None or 0: never).
    `responses_store_size`: most stored Responses API responses (least recently used go);
    `responses_store_path`: the store's SQLite file, shared by several API processes (None: in
    this process's memory).
    `drop_prompt_lines` / `volatile_prompt_lines`: regexes of system-prompt lines that change
    every request, dropped / moved after the history so the prefix cache keeps serving it
    (kiln.server.volatile_lines; None: off). An engine with `enable_lora` serves LoRA adapters
    by name (kiln.server.lora; load them with `lora.load_modules`); `lora_runtime_updates`
    False refuses /v1/load_lora_adapter and /v1/unload_lora_adapter (several API processes)."""
    if metrics_prefix not in PREFIXES:
        raise ValueError(
            f"metrics_prefix must be one of {sorted(PREFIXES)}, got {metrics_prefix!r}"
        )
    if max_tokens_default is not None and max_tokens_default < 1:
        raise ValueError(f"max_tokens_default must be >= 1, got {max_tokens_default}")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_PARSERS)}")
    if max_seqs_per_request is not None and max_seqs_per_request < 1:
        raise ValueError(f"max_seqs_per_request must be >= 1, got {max_seqs_per_request}")
    if max_waiting < 1:
        raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    lifespan = None
    if grpc_port is not None:
        lifespan = kserve.grpc_lifespan(grpc_host, grpc_port, api_key, max_body_bytes)
    app = FastAPI(
        title="kiln",
        version=kiln.__version__,
        summary="OpenAI-compatible LLM server",
        lifespan=lifespan,
    )
    app.state.kiln = ServerState(
        engine=async_engine,
        model_name=served_model_name,
        lifecycle=Lifecycle(max_waiting, max_seqs_per_request),
        metrics=ServerMetrics(
            served_model_name,
            async_engine.info.max_model_len,
            async_engine.info.cache_config,
            prefix=metrics_prefix,
            multiprocess_dir=metrics_multiprocess_dir,
        ),
        max_tokens_default=max_tokens_default,
        tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser,
    )
    state = app.state.kiln
    state.prompt_lines = PromptLineRules.parse(drop_prompt_lines, volatile_prompt_lines)
    state.stall = StallWatch(async_engine, state.lifecycle, stall_timeout_s)
    state.stall.register(state.metrics.registry, metrics_prefix)
    engine_config = async_engine.engine.config
    if engine_config.enable_lora:
        state.adapters = lora.LoRAAdapters(served_model_name, lora_runtime_updates)
        state.metrics.set_adapters([], engine_config.max_loras)
    app.state.responses = ResponseStore(responses_store_size, responses_store_path or IN_MEMORY)
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(routes.router)
    app.include_router(lora.router)  # vLLM's /v1/load_lora_adapter, /v1/unload_lora_adapter
    app.include_router(responses.router)  # OpenAI's Responses API: /v1/responses
    app.include_router(messages.router)  # Anthropic's Messages API: /v1/messages
    app.include_router(kserve.router)  # KServe v2 / Triton: /v2/...
    app.add_middleware(
        GuardMiddleware,
        api_key=api_key,
        max_body_bytes=max_body_bytes,
        metrics_api_key=metrics_api_key,
    )
    return app
