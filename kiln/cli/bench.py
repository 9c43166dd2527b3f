"""`kiln bench throughput|latency`: kiln on synthetic requests, optionally beside HF generate.
`kiln bench serve --base-url URL`: the same requests as load on a running server."""

from __future__ import annotations

import argparse

from kiln.cli.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure throughput or latency (optionally vs a baseline)")
    p.add_argument("mode", choices=["throughput", "latency", "serve"])
    p.add_argument("--num-requests", type=int, default=None, help="default: 64 / 3 (latency)")
    p.add_argument("--input-len", default="128", help="N or LOW:HIGH (uniform, seeded)")
    p.add_argument("--output-len", default="128", help="N or LOW:HIGH (uniform, seeded)")
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument(
        "--concurrency",
        "--max-concurrency",  # vLLM's benchmark_serving name
        type=int,
        default=None,
        help="cap on requests in flight (serve: default all at once)",
    )
    p.add_argument("--baseline", choices=["none", "hf"], default="none")
    p.add_argument("--hf-batch-size", type=int, default=None, help="default: all at once")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing")
    p.add_argument("--output-json", default=None)
    g = p.add_argument_group("serve mode (no local model)")
    g.add_argument("--base-url", default="http://127.0.0.1:8000")
    g.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson req/s")
    g.add_argument("--api-key", default=None)
    g.add_argument("--vocab-size", type=int, default=None, help="default: from /v1/models")
    g.add_argument(
        "--num-clients",
        type=int,
        default=None,
        help="client processes (default: one per 64 in flight, up to the CPUs less one)",
    )
    g.add_argument("--no-stream", action="store_true", help="whole responses, not SSE")
    g.add_argument(
        "--check-client",
        action="store_true",
        help="rerun with one more client process and report the gain (none: not the client)",
    )
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.mode == "serve":
        from kiln.bench.serve_client import run_serve_bench

        run_serve_bench(args)
        return 0
    from kiln.bench.runner import run_bench

    run_bench(args, engine_config_from_args(args))
    return 0
