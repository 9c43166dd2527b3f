"""One line per `kiln bench` JSON of a suite run: its row, the row's metric, the Triton kernels
compiled in its timed run, and, with --baseline, the recorded value of the same row and the ratio.

    python3 benchmarks/bench_summary.py benchmarks/out/RUN --baseline benchmarks/baselines/h200.json
    python3 benchmarks/bench_summary.py RUN/8b_fp8_128x128.json ...

A row's metric is output tok/s for throughput runs and decode tok/s for latency runs (MEASURING.md);
a baseline file is `benchmarks/baselines/<gpu>.json`, keyed by the suite's row names.
"""

from __future__ import annotations

import argparse
import glob
import json
import os


def metric(record: dict) -> tuple[str, float]:
    kiln = record["kiln"]
    name = "decode_tok_s" if record.get("mode") == "latency" else "output_tok_s"
    return name, kiln.get(name, kiln["output_tok_s"])


def recorded(baselines: dict, row: str) -> float | None:
    entry = baselines.get("rows", {}).get(row) or {}
    return (entry.get("record") or {}).get("value")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="a suite run's folder, or kiln bench JSON files")
    parser.add_argument("--baseline", help="benchmarks/baselines/<gpu>.json")
    args = parser.parse_args()
    baselines = {}
    if args.baseline:
        with open(args.baseline) as f:
            baselines = json.load(f)
    paths = []
    for path in args.paths:
        paths += sorted(glob.glob(os.path.join(path, "*.json"))) if os.path.isdir(path) else [path]
    for path in paths:
        with open(path) as f:
            record = json.load(f)
        if "kiln" not in record:
            continue  # a product benchmark's own JSON: read it whole
        row = os.path.basename(path).removesuffix(".json")
        name, value = metric(record)
        compiles = len((record.get("kernel_compiles") or {}).get("timed_run", []))
        line = f"{row:26s} {name} {value:10.1f}  compiles {compiles}"
        occupancy = record.get("kv_occupancy")
        if occupancy and record.get("mode") == "throughput":  # long rows: what fit at once
            o = occupancy
            line += (
                f"  at once {o['peak_sequences']} x {o['context_len']} (plan "
                f"{o['plan_sequences']}, every layer {o['plan_sequences_every_layer']})"
            )
        if "hf" in record:
            line += f"  HF {record['hf'].get(name, 0):.1f} (same run)"
        base = recorded(baselines, row)
        if base is not None:
            line += f"  recorded {base:.1f}: {value / base:.3f}x"
        print(line)


if __name__ == "__main__":
    main()
