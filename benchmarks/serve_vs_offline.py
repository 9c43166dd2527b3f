"""Serve vs offline in one run: the offline engine (`kiln bench throughput`) and `kiln serve`
(`kiln bench serve`, streaming and not) on the same requests, per concurrency and shape.

Each shape starts one `kiln serve` per serve variant (`--serve-variants`, each a string of extra
serve flags, "" the plain server: e.g. `--serve-variants "" "--api-server-count 2"` compares one
API process with two in the same run; SERVE_FLAGS adds flags to every variant, e.g.
"--no-engine-process" or "--stream-interval 4"), so a server is warm across concurrencies; the
offline run comes first, on the same engine flags, with no server alive. Writes one JSON per
cell and `serve_vs_offline.json` + `.md` (the table docs/performance.md takes).

    python benchmarks/serve_vs_offline.py --out DIR --shapes 128x128 1000x1000 \
        --concurrency 1 64 256 512 --check-client-from 256 \
        -- --model llama-3.1-8b --load-format dummy --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kiln(*args: str) -> list[str]:
    return [sys.executable, "-m", "kiln.cli.main", *args]


def _run_json(cmd: list[str], path: str, timeout: float) -> dict | None:
    print("+", shlex.join(cmd), flush=True)
    try:
        subprocess.run([*cmd, "--output-json", path], check=True, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"failed: {exc}", flush=True)
        return None
    with open(path) as f:
        return json.load(f)


def _start_server(
    engine_flags: list[str], variant: str, port: int, max_seqs: int
) -> subprocess.Popen:
    extra = shlex.split(os.environ.get("SERVE_FLAGS", "")) + shlex.split(variant)
    cmd = _kiln("serve", "--port", str(port), "--log-level", "warning", *engine_flags, *extra)
    cmd += ["--max-num-seqs", str(max_seqs), "--max-waiting", "100000"]
    cmd += ["--max-seqs-per-request", "100000"]
    print("+", shlex.join(cmd), flush=True)
    proc = subprocess.Popen(cmd)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kiln serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.TransportError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError("kiln serve did not become healthy")


def _cell(rec: dict | None) -> dict | None:
    if rec is None:
        return None
    k = rec["kiln"]
    cell = {"output_tok_s": k["output_tok_s"]}
    for metric in ("ttft", "itl", "tpot"):
        if k.get(metric):
            cell[metric] = {q: k[metric][q] for q in ("mean_ms", "p50_ms", "p99_ms")}
    if "client" in rec:
        cell["client"] = rec["client"]
    return cell


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--shapes", nargs="+", default=["128x128"])
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 64])
    p.add_argument("--requests-per-concurrency", type=float, default=2.0)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument(
        "--check-client-from",
        type=int,
        default=None,
        help="from this concurrency on, rerun each streaming cell with one more client process",
    )
    p.add_argument(
        "--serve-variants",
        nargs="+",
        default=[""],
        help='kiln serve flags per server to compare, "" the plain one (each its own server)',
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=["stream", "no-stream"],
        default=["stream", "no-stream"],
        help="which serve runs each cell makes",
    )
    p.add_argument("engine_flags", nargs=argparse.REMAINDER)
    args = p.parse_args()
    engine_flags = [f for f in args.engine_flags if f != "--"]
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for shape in args.shapes:
        input_len, output_len = shape.split("x")
        work = {
            c: max(args.min_requests, int(c * args.requests_per_concurrency))
            for c in args.concurrency
        }
        offline = {}
        for c in args.concurrency:  # offline first: no server holds the device
            path = os.path.join(args.out, f"offline_{shape}_c{c}.json")
            cmd = _kiln("bench", "throughput", *engine_flags, "--no-progress")
            cmd += ["--input-len", input_len, "--output-len", output_len]
            cmd += ["--num-requests", str(work[c]), "--concurrency", str(c)]
            # The same in-flight limit the server gets (_start_server): without it the offline
            # engine keeps its default of 256 and is no ceiling above that.
            cmd += ["--max-num-seqs", str(c)]
            # One wave untimed first: a kernel variant compiled inside the timed run (a prefill
            # tile at c256, 4.5 s into a 5.4 s run) made the server look faster than the engine.
            cmd += ["--warmup", str(c)]
            offline[c] = _cell(_run_json(cmd, path, args.timeout))
        shape_rows = {
            c: {"shape": shape, "concurrency": c, "num_requests": work[c], "offline": offline[c]}
            for c in args.concurrency
        }
        for v, variant in enumerate(args.serve_variants):
            port = _free_port()
            server = _start_server(engine_flags, variant, port, max(args.concurrency))
            tag = f"_v{v}" if len(args.serve_variants) > 1 else ""
            try:
                for c in args.concurrency:
                    row = shape_rows[c]
                    cells = row.setdefault("serve", {}).setdefault(variant or "default", {})
                    for stream in (mode == "stream" for mode in args.modes):
                        kind = "stream" if stream else "nostream"
                        name = f"serve_{shape}_c{c}_{kind}{tag}.json"
                        cmd = _kiln("bench", "serve", "--base-url", f"http://127.0.0.1:{port}")
                        cmd += ["--input-len", input_len, "--output-len", output_len]
                        cmd += ["--num-requests", str(work[c]), "--concurrency", str(c)]
                        cmd += [] if stream else ["--no-stream"]
                        # Fresh random prompts per run (same lengths, same work): one server
                        # serves every run of the shape, and repeated prompts would hit its
                        # prefix cache.
                        seed = 1000 * c + 10 * v + (1 if stream else 2)
                        cmd += ["--dataset-seed", str(seed)]
                        check = args.check_client_from is not None and c >= args.check_client_from
                        cmd += ["--check-client"] if stream and check else []
                        cell = _cell(_run_json(cmd, os.path.join(args.out, name), args.timeout))
                        cells["stream" if stream else "no_stream"] = cell
                        if cell and offline[c]:
                            cell["vs_offline"] = cell["output_tok_s"] / offline[c]["output_tok_s"]
                        if v == 0:  # the first variant's cells, where earlier records had them
                            row["stream" if stream else "no_stream"] = cell
                    print(json.dumps({"variant": variant, **row}), flush=True)
            finally:
                server.terminate()
                server.wait(120)
        rows.extend(shape_rows.values())
    record = {
        "engine_flags": engine_flags,
        "serve_flags": os.environ.get("SERVE_FLAGS", ""),
        "serve_variants": args.serve_variants,
        "rows": rows,
    }
    with open(os.path.join(args.out, "serve_vs_offline.json"), "w") as f:
        json.dump(record, f, indent=1)
    with open(os.path.join(args.out, "serve_vs_offline.md"), "w") as f:
        f.write(_markdown(rows))
    print(_markdown(rows))
    # The whole record in the log too: a device run may bring back only some of the files.
    print("serve_vs_offline.json:", json.dumps(record), flush=True)
    return 0


def _markdown(rows: list[dict]) -> str:
    def tok(cell: dict | None) -> str:
        return "failed" if cell is None else f"{cell['output_tok_s']:,.0f}"

    def pct(cell: dict | None) -> str:
        return "" if not cell or "vs_offline" not in cell else f" ({cell['vs_offline']:.0%})"

    def lat(cell: dict | None, metric: str) -> str:
        if not cell or metric not in cell:
            return "-"
        q = cell[metric]
        mean = f"{q['mean_ms']:.1f} / " if metric == "itl" else ""  # tokens sent together: 0 ms
        return f"{mean}{q['p50_ms']:.1f} / {q['p99_ms']:.1f}"

    lines = [
        "| shape | conc. | serve flags | offline tok/s | serve stream tok/s "
        "| serve non-stream tok/s | TTFT p50/p99 ms offline | TTFT stream "
        "| ITL mean/p50/p99 ms offline | ITL stream | client CPU (stream) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        off = r["offline"]
        for variant, cells in r.get("serve", {"default": r}).items():
            s, ns = cells.get("stream"), cells.get("no_stream")
            client = "-"
            if s and "client" in s:
                utils = [c["cpu_util"] for c in s["client"]["processes"]]
                client = f"{len(utils)} x max {max(utils):.0%}"
                if "one_more_client_gain" in s["client"]:
                    client += f", +1 client {s['client']['one_more_client_gain']:+.1%}"
            cells_md = [r["shape"], str(r["concurrency"]), variant, tok(off)]
            cells_md += ["-" if "stream" not in cells else tok(s) + pct(s)]
            cells_md += ["-" if "no_stream" not in cells else tok(ns) + pct(ns)]
            cells_md += [lat(off, "ttft"), lat(s, "ttft"), lat(off, "itl"), lat(s, "itl"), client]
            lines.append("| " + " | ".join(cells_md) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
