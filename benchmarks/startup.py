"""Cold-process startup: seconds from process start to the first generated token on stdout, or to
`GET /health` answering 200, repeated; min and median, with the load average around each run.

    python benchmarks/startup.py generate -- kiln generate --max-tokens 8 "What is 2+2?"
    python benchmarks/startup.py health --port 8131 -- kiln serve --port 8131
    python benchmarks/startup.py first-line -- python -c "...; print(out)"   # any program

`generate` times the first non-empty byte the program writes to stdout (kiln generate streams its
first token there and prints nothing before); `first-line` the first full line (with `--match`,
the first containing that text: vLLM logs to stdout too), for a program that prints its output
at once, as a script around vLLM's offline LLM.generate does; `health` the first 200 from
/health (polled every 50 ms), after which the server gets SIGTERM. The process is started by
this script, so import time, model load and KV-cache allocation are all inside the number.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
import urllib.request


def _first_output(cmd: list[str], whole_line: bool, timeout: float, match: str | None) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while True:
            chunk = proc.stdout.readline() if whole_line else proc.stdout.read(1)
            if not chunk:
                raise RuntimeError(f"{cmd[0]} exited ({proc.wait()}) before printing anything")
            if chunk.strip() and (match is None or match.encode() in chunk):
                return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                raise RuntimeError("timed out")
    finally:
        _end(proc, signal.SIGKILL)


def _healthy(cmd: list[str], port: int, timeout: float) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{cmd[0]} exited ({proc.returncode}) before /health answered")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                    if r.status == 200:
                        return time.perf_counter() - start
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("timed out")
    finally:
        _end(proc, signal.SIGTERM)


def _children_cpu() -> float:
    """User + system seconds of the ended children: what the run cost the CPU, whatever else
    ran beside it (includes the few ms between the measured moment and the kill / drain)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _end(proc: subprocess.Popen, sig: int) -> None:
    """Signal the command's whole process group (vLLM runs its engine in child processes)."""
    try:
        os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["generate", "first-line", "health"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--port", type=int, default=8131, help="health: the server's port")
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--label", default=None)
    parser.add_argument("--match", default=None, help="first-line: the first line with this text")
    parser.add_argument("--output-json", default=None, help="append one record (JSON lines)")
    argv = sys.argv[1:]
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        parser.error("give the command after --")
    cut = argv.index("--")
    args, cmd = parser.parse_args(argv[:cut]), argv[cut + 1 :]
    runs = []
    for _ in range(args.runs):
        load_before = os.getloadavg()[0]
        cpu_before = _children_cpu()
        if args.what == "health":
            seconds = _healthy(cmd, args.port, args.timeout)
        else:
            seconds = _first_output(cmd, args.what == "first-line", args.timeout, args.match)
        cpu = _children_cpu() - cpu_before
        runs.append({"seconds": seconds, "cpu_s": cpu, "load_1min_before": load_before})
        print(f"{seconds:.2f} s wall, {cpu:.2f} s CPU (load {load_before:.2f})", flush=True)
    times = [r["seconds"] for r in runs]
    record = {
        "label": args.label or " ".join(cmd),
        "what": args.what,
        "command": cmd,
        "runs": runs,
        "min_s": min(times),
        "median_s": statistics.median(times),
        "min_cpu_s": min(r["cpu_s"] for r in runs),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS",) if k in os.environ},
    }
    print(f"min {record['min_s']:.2f} s, median {record['median_s']:.2f} s over {len(times)}")
    if args.output_json:
        with open(args.output_json, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
