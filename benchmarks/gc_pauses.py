"""Python's garbage collector during an offline run on the CPU: how many collections of each
generation, and how long they stall the host, at a given gen-0 threshold.

    PYTHONPATH=. python3 benchmarks/gc_pauses.py --threshold 0 --out gc_0.json      # Python's 700
    PYTHONPATH=. python3 benchmarks/gc_pauses.py --threshold 20000 --out gc_20000.json

A tiny random Llama (no download) serves `--requests` requests of `--input-len` prompt tokens and
`--output-len` output tokens through kiln bench's offline loop; every collection is timed with
gc.callbacks. Found from the H200 1000/1000 step trace (docs/performance.md, "Host stalls"): the
host stalls are full collections, and their count and length do not depend on the GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests.conftest's tiny model

from kiln.bench.offline import run_kiln
from kiln.bench.workload import BenchRequest
from kiln.llm import LLM
from tests.conftest import build_tiny_hf_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--threshold", type=int, required=True, help="gc_gen0_threshold (0: Python's)")
    p.add_argument("--requests", type=int, default=384)
    p.add_argument("--input-len", type=int, default=600)
    p.add_argument("--output-len", type=int, default=600)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    model_dir = tempfile.mkdtemp()
    build_tiny_hf_model("llama-gqa", model_dir)
    llm = LLM(
        model_dir,
        max_num_seqs=args.requests,
        max_num_batched_tokens=8192,
        max_model_len=args.input_len + args.output_len + 16,
        kv_cache_memory_gb=2,
        gc_gen0_threshold=args.threshold,
    )
    pauses: list[tuple[int, float]] = []  # (generation, ms)
    started = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], (time.perf_counter() - started[0]) * 1000))

    rng = random.Random(0)
    requests = [
        BenchRequest([rng.randrange(10, 250) for _ in range(args.input_len)], args.output_len)
        for _ in range(args.requests)
    ]
    steps = [0]
    step = llm.engine.step

    def counted_step():
        steps[0] += 1
        return step()

    llm.engine.step = counted_step
    gc.callbacks.append(on_gc)
    start = time.perf_counter()
    run_kiln(llm.engine, requests, progress=False)
    wall = time.perf_counter() - start
    gc.callbacks.remove(on_gc)
    by_generation = {}
    for generation in range(3):
        ms = [t for g, t in pauses if g == generation]
        by_generation[f"gen{generation}"] = {
            "collections": len(ms),
            "total_ms": round(sum(ms), 1),
            "max_ms": round(max(ms, default=0.0), 1),
        }
    record = {
        "command": " ".join(sys.argv),
        "python": sys.version.split()[0],
        "gc_threshold_during_run": gc.get_threshold(),
        "steps": steps[0],
        "wall_s": round(wall, 1),
        **by_generation,
    }
    Path(args.out).write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
