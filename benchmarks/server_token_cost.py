"""The server's own cost per streamed token, on the CPU: `kiln serve` over a tiny random Llama
(2 layers, width 64: the engine's step is cheap, so HTTP, JSON, SSE and the engine's host work
are what is measured), driven by `kiln bench serve`'s client processes. Reports output tok/s and
the CPU seconds per token of the API process and of the engine process (utime + stime from
/proc), so a before/after of the hot path reads in microseconds per token.

    python benchmarks/server_token_cost.py --out FILE.json [--tree DIR] [--label L] \
        [--serve-flags "--no-engine-process"] [--concurrency 64] [--num-requests 256]

`--tree` runs another checkout's kiln as the server (e.g. the commit before), the client is this
tree's. With `--serve-flags "--api-server-count N"` the API CPU is the launcher's and its N API
processes' together (each one's is listed too).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from kiln.bench.serve_client import run_load
from kiln.bench.workload import synthetic_requests


def _tiny_model(path: str) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)


def _cpu_s(pid: int) -> float:
    user, system = _user_system_s(pid)
    return user + system


def _user_system_s(pid: int) -> tuple[float, float]:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tree", default=None, help="the server's checkout (default: this one)")
    p.add_argument("--label", default="")
    p.add_argument("--serve-flags", default="")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-clients", type=int, default=1)
    args = p.parse_args()
    model = tempfile.mkdtemp(prefix="kiln-tiny-")
    _tiny_model(model)
    port = 8700 + os.getpid() % 200
    env = {**os.environ, "PYTHONPATH": args.tree or os.getcwd(), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "kiln.cli.main", "serve", "--model", model, "--port", str(port)]
    cmd += ["--log-level", "warning", "--max-num-seqs", str(args.concurrency)]
    cmd += ["--kv-cache-memory-gb", "0.25", *shlex.split(args.serve_flags)]
    server = subprocess.Popen(cmd, env=env, cwd=args.tree or os.getcwd())
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("kiln serve did not start")
            time.sleep(0.5)
        children = _children(server.pid)
        engine = [c for c in children if "kiln.engine_core" in _cmdline(c)]
        # The launcher and its API processes (the engine process aside; --api-server-count N).
        api_pids = [server.pid] + [c for c in children if "spawn_main" in _cmdline(c)]
        requests = synthetic_requests(args.num_requests + 8, "16", str(args.output_len), 512, 0)
        load = (base, None, model, requests[:8], 8, float("inf"), 0, True, 1)
        run_load(*load)  # warm-up
        api0 = [_user_system_s(p) for p in api_pids]
        eng0 = [_cpu_s(c) for c in engine]
        t0 = time.perf_counter()
        timings, failures, clients = run_load(
            base, None, model, requests[8:], args.concurrency, float("inf"), 1, True,
            args.num_clients,
        )  # fmt: skip
        wall = time.perf_counter() - t0
        api_each = [
            tuple(a - b for a, b in zip(_user_system_s(p), before))
            for p, before in zip(api_pids, api0)
        ]
        api = sum(u + s for u, s in api_each)
        eng = sum(_cpu_s(c) - e for c, e in zip(engine, eng0))
    finally:
        server.terminate()
        server.wait(60)
    tokens = sum(len(t.token_times) for t in timings)
    record = {
        "label": args.label,
        "tree": args.tree or "this",
        "serve_flags": args.serve_flags,
        "concurrency": args.concurrency,
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "failed": len(failures),
        "output_tok_s": tokens / wall,
        "api_process_cpu_us_per_token": api / tokens * 1e6,
        "engine_process_cpu_us_per_token": eng / tokens * 1e6 if engine else None,
        "api_process_cpu_util": api / wall,
        # per API process (the launcher first when there are several): user, system us/token
        "api_processes_user_system_us_per_token": [
            [u / tokens * 1e6, s / tokens * 1e6] for u, s in api_each
        ],
        "client": clients,
        "load_avg_1_5_15": list(os.getloadavg()),
    }
    print(json.dumps(record, indent=1))
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
