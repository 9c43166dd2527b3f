"""Outlier columns end to end: static fp8 engines of a preset's shape (dummy weights), built with
and without `--outlier-columns 16`, then the same `kiln bench` workloads on each, in one run.

    python3 benchmarks/outlier_columns_e2e.py --work /tmp/oc --out oc_e2e.json        # the H200
    python3 benchmarks/outlier_columns_e2e.py --preset smollm2-135m --dry-run \\
        --work /tmp/oc --out /tmp/oc.json                                              # the CPU

benchmarks/outlier_columns_cost.py times the decoder's blocks (+0-5% from 16 rows up, one row
1.13-1.40x before the small-batch path; results/2026-12-05-h200-decode-occupancy-outlier-cost/);
a step also runs attention, the LM head and the sampler, which outlier columns do not touch, so
an engine should lose less. This measures it. The source is build_and_first_token's dummy
checkpoint (normal weights, std 0.02) plus the tests' tiny byte-level BPE tokenizer (its ids fit
any preset's vocabulary): a static build calibrates its scales and chooses the channels on text,
here this repository's README (`../shared` does not travel to the GPU machine). Random weights
have no perplexity worth checking: `--no-accuracy-check`. Both engines: static fp8, float8 KV
cache (TensorRT-LLM's FP8 setup), max_model_len 2048.

Workloads, each engine in its own process, alternating plain / outlier: batch-1 decode at 1k
context, 128/128 (2048 requests, 512 in flight) and 1000/1000 (512 requests, all in flight).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from build_and_first_token import write_dummy_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (name, `kiln bench` arguments); --dry-run shrinks the lengths and counts
WORKLOADS = (  # batch 1 first: its blocks cost the most (1.13-1.40x), and a cut run keeps it
    ("lat1k", ["latency", "--input-len", "1024", "--output-len", "128", "--num-requests", "3"]),
    ("tput128", ["throughput", "--input-len", "128", "--output-len", "128", "--num-requests",
                 "2048", "--max-num-seqs", "512", "--max-num-batched-tokens", "8192",
                 "--warmup", "64"]),
    # one wave of 512: the decode steps of 1000/1000 (512 rows, 1-2k contexts) in half the time
    ("tput1000", ["throughput", "--input-len", "1000", "--output-len", "1000", "--num-requests",
                  "512", "--max-num-seqs", "512", "--max-num-batched-tokens", "16384",
                  "--warmup", "16"]),
)  # fmt: skip
DRY_RUN = {"2048": "8", "1000": "24", "1024": "24", "512": "4", "128": "8", "64": "1", "16": "1"}


def write_source(preset: str, path: str, device: str) -> float:
    """The dummy checkpoint with a tokenizer (the tests' tiny BPE) and a generation config."""
    sys.path.insert(0, ROOT)  # tests.tiny_tokenizer
    from tests.tiny_tokenizer import build_tokenizer

    seconds = write_dummy_checkpoint(preset, path, device)
    build_tokenizer().save_pretrained(path)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": 2}, f)
    return seconds


def build(source: str, engine: str, outlier_columns: int) -> dict:
    command = [
        sys.executable, "-P", "-m", "kiln.cli.main", "build", source, "-o", engine,
        "--quantization", "fp8", "--kv-cache-dtype", "fp8", "--max-model-len", "2048",
        "--calibration-data", os.path.join(ROOT, "README.md"), "--no-accuracy-check",
    ]  # fmt: skip
    if outlier_columns:
        command += ["--outlier-columns", str(outlier_columns)]
    t0 = time.time()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    result = {"command": command[3:], "exit": done.returncode, "seconds": time.time() - t0}
    if done.returncode:
        result["stderr_tail"] = done.stderr[-3000:]
    return result


def bench(engine: str, args: list[str], out: str, dry_run: bool) -> dict:
    if dry_run:
        args = [DRY_RUN.get(a, a) for a in args]
    command = [
        sys.executable, "-P", "-m", "kiln.cli.main", "bench", *args, "--model", engine,
        "--no-progress", "--output-json", out,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    result: dict = {"command": command[3:], "exit": done.returncode}
    if done.returncode:
        result["stderr_tail"] = done.stderr[-3000:]
    else:
        with open(out) as f:
            result["result"] = json.load(f)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-3.1-8b")
    parser.add_argument("--work", required=True, help="scratch folder: source, engines")
    parser.add_argument("--out", required=True)
    parser.add_argument("--outlier-columns", type=int, default=16)
    parser.add_argument("--dry-run", action="store_true", help="tiny workloads (the CPU)")
    names = [name for name, _ in WORKLOADS]
    parser.add_argument(
        "--workloads", nargs="+", choices=names, default=names, help="a subset (e.g. lat1k)"
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    source = os.path.join(args.work, "source")
    record: dict = {"preset": args.preset, "device": device, "columns": args.outlier_columns}
    record["write_source_s"] = write_source(args.preset, source, device)
    engines = {"plain": 0, "outlier": args.outlier_columns}
    record["builds"] = {
        name: build(source, os.path.join(args.work, name), n) for name, n in engines.items()
    }
    record["runs"] = []
    for workload, bench_args in WORKLOADS:
        if workload not in args.workloads:
            continue
        for name in engines:
            if record["builds"][name]["exit"]:
                continue
            out = os.path.join(args.work, f"{workload}_{name}.json")
            run = bench(os.path.join(args.work, name), bench_args, out, args.dry_run)
            record["runs"].append({"workload": workload, "engine": name, **run})
            kiln = run.get("result", {}).get("kiln", {})
            summary = {k: v for k, v in kiln.items() if not isinstance(v, (dict, list))}
            print(workload, name, run["exit"], json.dumps(summary)[:400], flush=True)
            with open(args.out, "w") as f:
                json.dump(record, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
