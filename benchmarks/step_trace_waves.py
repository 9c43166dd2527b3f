"""Decode attention's cost inside the engine's step, from a `kiln bench throughput` step trace.

    python3 benchmarks/step_trace_waves.py RESULT.json [RESULT.json ...] [--min-steps 100]

With identical requests (the fixed-length workloads: 1000/1000, 2048/128 ...) the sequences in
flight start and finish within a few steps, so a run is waves: prefill steps, then decode steps in
which every context grows by one token a step. Over such a wave a decode step's GPU time is a
line in the step's index: everything but attention (projections, norms, sampling) is the same
every step, so the slope is what one more token in each of the rows' contexts costs, decode
attention's marginal cost as the engine runs it (between its GEMMs, at the clock the power cap
leaves), and rows x KV bytes a token / slope the rate it reads the cache at. A kernel benchmark
times attention alone; this is the number end-to-end throughput follows
(benchmarks/results/2026-12-03-h200-decode-pipelining-l2-prefetch/: 3.63 TB/s in the step for a
kernel that reads 3.67 alone, and a candidate 3.5% faster alone 1% slower in the step).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass


@dataclass
class Wave:
    first_step: int  # index in the step trace
    steps: int
    rows: int  # sequences a step (the same in every step of the wave)
    slope_us: float  # GPU time added by one more token in each of the rows' contexts
    intercept_ms: float  # the fitted step at the wave's first step
    mean_ms: float
    kv_tb_s: float | None  # rows x KV bytes a token / slope: the cache's read rate at the margin


def waves(record: dict, min_steps: int = 100) -> list[Wave]:
    """The record's waves: runs of at least min_steps consecutive decode graph steps at the
    run's largest row count, each with its least-squares line."""
    trace = record["step_trace"]
    col = {name: i for i, name in enumerate(trace["columns"])}
    rows = trace["rows"]
    graph_rows = [r[col["num_seqs"]] for r in rows if r[col["graph"]]]
    if not graph_rows:
        return []
    full = max(graph_rows)
    plan = record.get("memory_plan") or {}
    kv_bytes = plan["kv_gib"] * 2**30 / plan["kv_tokens"] if plan.get("kv_tokens") else None
    found, run = [], []
    for i, r in enumerate([*rows, None]):  # a sentinel closes the last run
        if r is not None and r[col["graph"]] and r[col["num_seqs"]] == full:
            run.append((i, r[col["gpu"]]))
            continue
        if len(run) >= min_steps:
            found.append(_fit(run, full, kv_bytes))
        run = []
    return found


def _fit(run: list[tuple[int, float]], rows: int, kv_bytes: float | None) -> Wave:
    n = len(run)
    xs = [float(k) for k in range(n)]
    ys = [ms for _, ms in run]
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    rate = rows * kv_bytes / (slope * 1e-3) / 1e12 if kv_bytes and slope > 0 else None
    return Wave(run[0][0], n, rows, slope * 1e3, my - slope * mx, my, rate)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--min-steps", type=int, default=100)
    parser.add_argument("--json", help="write every file's waves here")
    args = parser.parse_args()
    out = {}
    for path in args.results:
        with open(path) as f:
            found = waves(json.load(f), args.min_steps)
        out[path] = [asdict(w) for w in found]
        print(path)
        for w in found:
            rate = f"{w.kv_tb_s:.2f} TB/s" if w.kv_tb_s else "-"
            print(
                f"  steps {w.first_step}-{w.first_step + w.steps - 1} at {w.rows} rows: "
                f"{w.slope_us:.2f} us a context token, {w.intercept_ms:.2f} ms at the first "
                f"step, mean {w.mean_ms:.2f} ms, KV {rate}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
