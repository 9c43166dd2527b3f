"""`kiln bench sweep`: the throughput-latency curve a user picks an operating point from.

One workload at several concurrency levels (requests in flight), each level with its own seeded
prompts (a prefix-cache hit on another level's prompts would flatter TTFT): in-process through
kiln's engine, loaded once (default), or against a server (`--base-url`, through `kiln bench
serve`'s client). Output: a table, a JSON record with every level's full report, and a PNG of
time per output token and TTFT against output tok/s, each point labelled with its concurrency
(matplotlib, the optional `[plot]` extra; without it the table and JSON are still written).
"""

from __future__ import annotations

import argparse
import copy
import os
import time

from kiln.config import EngineConfig

PLOT_HINT = "pip install 'kiln[plot]' (matplotlib)"


def parse_levels(spec: str) -> list[int]:
    try:
        levels = [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {spec!r}: give positive integers, e.g. 1,8,64,256")
    return levels


def run_sweep(args: argparse.Namespace, config: EngineConfig | None) -> dict:
    from kiln.bench.report import write_json

    try:
        levels = parse_levels(args.concurrency)
    except ValueError as e:
        from kiln.errors import KilnError

        raise KilnError(str(e)) from e
    points = []
    if config is None:
        facts, run_level = _serve_levels(args)
    else:
        facts, run_level = _engine_levels(args, config)
    for level in levels:
        num = args.num_requests or max(8, 4 * level)
        start = time.perf_counter()
        report = run_level(level, num, args.dataset_seed + level)
        points.append({"concurrency": level, "wall_s": time.perf_counter() - start, **report})
        print(f"concurrency {level}: {report['output_tok_s']:.1f} output tok/s", flush=True)
    record = {
        "mode": "sweep",
        **facts,
        "workload": {
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dataset_seed": args.dataset_seed,
            "levels": levels,
            "num_requests": args.num_requests,
        },
        "points": points,
    }
    print(format_sweep(points))
    if args.output_json:
        write_json(args.output_json, record)
        print(f"wrote {args.output_json}")
    png = args.output_png or (
        os.path.splitext(args.output_json)[0] + ".png" if args.output_json else None
    )
    if png:
        try:
            plot_sweep(record, png)
            print(f"wrote {png}")
        except ImportError:
            print(f"no plot: matplotlib is not installed ({PLOT_HINT}); table and JSON written")
    return record


def _engine_levels(args: argparse.Namespace, config: EngineConfig):
    import torch

    from kiln.bench.metrics import throughput_report
    from kiln.bench.offline import run_kiln
    from kiln.bench.report import engine_config_record, environment
    from kiln.bench.workload import synthetic_requests
    from kiln.engine.llm_engine import LLMEngine

    engine = LLMEngine(config)

    def requests(num: int, seed: int, output_len: str):
        vocab, avoid = engine.model_config.vocab_size, engine.eos_token_ids
        return synthetic_requests(num, args.input_len, output_len, vocab, seed, avoid)

    if args.warmup:
        run_kiln(engine, requests(args.warmup, args.dataset_seed - 1, "16"), progress=False)

    def run_level(level: int, num: int, seed: int) -> dict:
        timings = run_kiln(
            engine, requests(num, seed, args.output_len), level, not args.no_progress
        )
        return throughput_report(timings)

    facts = {
        "target": "engine",
        "model": engine.model_description,
        "dtype": engine.dtype,
        "engine_config": engine_config_record(config),
        "env": environment(torch.device(engine.device)),
    }
    return facts, run_level


def _serve_levels(args: argparse.Namespace):
    from kiln.bench.serve_client import run_serve_bench

    warmed: list[int] = []

    def run_level(level: int, num: int, seed: int) -> dict:
        level_args = copy.copy(args)
        level_args.concurrency, level_args.num_requests, level_args.dataset_seed = level, num, seed
        level_args.output_json = None
        level_args.warmup = 0 if warmed else args.warmup  # the first level warms the server
        warmed.append(level)
        record = run_serve_bench(level_args)
        return {**record["kiln"], "num_failed": record["num_failed"]}

    return {"target": "server", "base_url": args.base_url}, run_level


def format_sweep(points: list[dict]) -> str:
    head = ("conc", "reqs", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
            "E2E p50")  # fmt: skip
    rows = [head]
    for p in points:
        ms = lambda metric, stat, p=p: f"{p[metric].get(stat, float('nan')):,.0f}"
        rows.append(
            (
                str(p["concurrency"]),
                str(p["num_requests"]),
                f"{p['output_tok_s']:,.1f}",
                f"{p['request_s']:.2f}",
                ms("ttft", "p50_ms"),
                ms("ttft", "p99_ms"),
                ms("tpot", "p50_ms"),
                ms("tpot", "p99_ms"),
                ms("e2e", "p50_ms"),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n(latencies in ms)"


def plot_sweep(record: dict, path: str) -> None:
    """Two panels against output tok/s: TPOT p50 (the per-user speed) and TTFT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = record["points"]
    x = [p["output_tok_s"] for p in points]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, metric, label in (
        (axes[0], "tpot", "time per output token p50 (ms)"),
        (axes[1], "ttft", "time to first token p50 (ms)"),
    ):
        y = [p[metric].get("p50_ms", float("nan")) for p in points]
        ax.plot(x, y, marker="o")
        for xi, yi, p in zip(x, y, points):
            ax.annotate(
                f"c={p['concurrency']}", (xi, yi), textcoords="offset points", xytext=(4, 4)
            )
        ax.set_xlabel("output tok/s (all requests)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    workload = record["workload"]
    title = (record.get("model") or record.get("base_url", "")).rsplit("/", 1)[-1]
    fig.suptitle(f"{title}: {workload['input_len']} in / {workload['output_len']} out")
    fig.savefig(path, dpi=110)
    plt.close(fig)
