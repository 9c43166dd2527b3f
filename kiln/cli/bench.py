"""`kiln bench throughput|latency`: kiln on synthetic requests, optionally beside HF generate.
`kiln bench serve --base-url URL`: the same requests as load on a running server.
`kiln bench sweep --concurrency 1,8,64`: the throughput-latency curve (table, JSON, PNG).
`kiln bench compare OLD.json NEW.json`: two records side by side; exit 1 on a regression.

Each mode is its own sub-command with its own `--help`. vLLM's benchmark flag names are accepted
beside kiln's (`--num-prompts`, `--max-concurrency`, `--random-input-len`, `--random-output-len`,
`--dataset-name random`, `--save-result` with `--result-dir` / `--result-filename`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os

from kiln.cli import bench_compare
from kiln.cli.engine_args import add_engine_args, engine_config_from_args
from kiln.cli.output_file import check_output_file
from kiln.cli.vllm_flags import (
    DEFAULT_BASE_URL,
    UnsupportedFlagError,
    add_vllm_bench_flags,
    resolve_vllm_bench_flags,
)
from kiln.config import EngineConfig
from kiln.errors import KilnError

_MODES = {
    "throughput": "kiln's engine on synthetic requests, all submitted at once",
    "latency": "one request at a time: TTFT, TPOT, decode tok/s against the roofline",
    "serve": "load on a running OpenAI-compatible server (kiln's, vLLM's, ...)",
    "sweep": "the throughput-latency curve over several concurrencies: table, JSON, PNG",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure throughput or latency (optionally vs a baseline)")
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode, text in _MODES.items():
        m = modes.add_parser(mode, help=text, description=text)
        _add_workload_args(m, mode)
        if mode in ("serve", "sweep"):
            _add_serve_args(m, optional=mode == "sweep")
        if mode in ("throughput", "latency"):
            m.add_argument("--baseline", choices=["none", "hf"], default="none")
            m.add_argument("--hf-batch-size", type=int, default=None, help="default: all at once")
            _add_lora_args(m)
        if mode != "serve":
            add_engine_args(m)
            _add_oracle_args(m)
        add_vllm_bench_flags(m, mode)
        m.set_defaults(func=run)
    bench_compare.add_parser(modes)


def _add_workload_args(p: argparse.ArgumentParser, mode: str) -> None:
    sweep = mode == "sweep"
    p.add_argument(
        "--num-requests",
        "--num-prompts",  # vLLM's name
        type=int,
        default=None,
        help="requests per concurrency level (default: 4x the level, at least 8)"
        if sweep
        else f"default: {3 if mode == 'latency' else 64}",
    )
    p.add_argument(
        "--input-len",
        "--random-input-len",  # vLLM's name
        default="128",
        help="N or LOW:HIGH (uniform, seeded)",
    )
    p.add_argument(
        "--output-len", "--random-output-len", default="128", help="N or LOW:HIGH (uniform, seeded)"
    )
    p.add_argument("--dataset-seed", type=int, default=0)
    p.add_argument(
        "--dataset-name",
        default="random",
        choices=("random", "sharegpt"),
        help="random: synthetic token ids, as trtllm-bench's; sharegpt: vLLM's ShareGPT file "
        "(--dataset-path)",
    )
    if sweep:
        p.add_argument(
            "--concurrency",
            "--max-concurrency",
            default="1,8,64,256",
            help="comma-separated levels of requests in flight (default: %(default)s)",
        )
    else:
        p.add_argument(
            "--concurrency",
            "--max-concurrency",  # vLLM's name
            type=int,
            default=None,
            help="cap on requests in flight",
        )
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests before timing")
    p.add_argument("--output-json", default=None)
    p.add_argument(
        "--save-result",
        action="store_true",
        help="vLLM's flag: write the JSON record to --result-dir/--result-filename",
    )
    p.add_argument("--result-dir", default=None, help="with --save-result (default: .)")
    p.add_argument(
        "--result-filename", default=None, help="with --save-result (default: kiln-MODE-DATE.json)"
    )
    if sweep:
        p.add_argument("--output-png", default=None, help="the plot (default: beside the JSON)")
    p.add_argument("--no-progress", action="store_true")


def _add_oracle_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding at a set acceptance (any weights)")
    g.add_argument(
        "--oracle-acceptance-length",
        type=float,
        default=None,
        metavar="L",
        help="an oracle drafts K tokens a decode step and its own seeded draw accepts them at "
        "mean length L (1 to K + 1 tokens a verification): speculation's speed on any weights, "
        "random ones too; the output is then not the model's text",
    )
    g.add_argument(
        "--oracle-num-tokens",
        type=int,
        default=4,
        metavar="K",
        help="the oracle's drafts a step (default: %(default)s)",
    )


def _add_lora_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("LoRA's cost (random adapters of the model's shapes)")
    g.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        metavar="N",
        help="N random adapters on all seven projections, request i running adapter i mod N "
        "(turns --enable-lora on with max_loras >= N)",
    )
    g.add_argument("--lora-rank", type=int, default=16, help="their rank (default: 16)")


def _with_lora(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """The engine config with room for --lora-adapters' adapters."""
    count = getattr(args, "lora_adapters", 0)
    if not count:
        return config
    if count < 0 or args.lora_rank < 1:
        raise KilnError("--lora-adapters and --lora-rank must be positive")
    return dataclasses.replace(
        config,
        enable_lora=True,
        max_loras=max(config.max_loras, count),
        max_lora_rank=max(config.max_lora_rank, args.lora_rank),
    )


def _with_oracle(args: argparse.Namespace, config: EngineConfig) -> EngineConfig:
    """The engine config with the oracle as its proposer, where --oracle-acceptance-length asks."""
    if args.oracle_acceptance_length is None:
        return config
    if config.speculative_config is not None:
        raise KilnError("give --oracle-acceptance-length or --speculative-config, not both")
    from kiln.bench.oracle import oracle_at_length

    try:
        spec = oracle_at_length(args.oracle_num_tokens, args.oracle_acceptance_length)
    except ValueError as exc:
        raise KilnError(f"--oracle-acceptance-length: {exc}") from None
    return dataclasses.replace(config, speculative_config=spec)


def _add_serve_args(p: argparse.ArgumentParser, optional: bool) -> None:
    title = "server (sweep: give --base-url to sweep a server)" if optional else "server"
    g = p.add_argument_group(title)
    g.add_argument(
        "--base-url", default=None, help=None if optional else f"default: {DEFAULT_BASE_URL}"
    )
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


def _resolve_vllm_names(args: argparse.Namespace) -> None:
    resolve_vllm_bench_flags(args)
    if (args.result_dir or args.result_filename) and not args.save_result:
        raise UnsupportedFlagError("--result-dir/--result-filename need --save-result")
    if args.save_result and not args.output_json:
        date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = args.result_filename or f"kiln-{args.mode}-{date}.json"
        directory = args.result_dir or "."
        args.output_json = os.path.join(directory, name)
    # Checked (its folder made) before the run: a benchmark is never lost to a missing folder.
    for flag in ("output_json", "output_png"):
        if getattr(args, flag, None):
            check_output_file(getattr(args, flag), "--" + flag.replace("_", "-"))


def run(args: argparse.Namespace) -> int:
    _resolve_vllm_names(args)
    if args.mode == "serve":
        from kiln.bench.serve_client import run_serve_bench

        run_serve_bench(args)
        return 0
    if args.mode == "sweep":
        from kiln.bench.sweep import run_sweep

        config = None if args.base_url else _with_oracle(args, engine_config_from_args(args))
        run_sweep(args, config)
        return 0
    from kiln.bench.runner import run_bench

    run_bench(args, _with_lora(args, _with_oracle(args, engine_config_from_args(args))))
    return 0
