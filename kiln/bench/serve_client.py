"""`kiln bench serve`: load on an OpenAI-compatible server, timed per token as the client sees it.

Streams /v1/completions with synthetic random token-id prompts (trtllm-bench's workload; EOS
ignored, greedy). Arrivals: all at once (the default), a seeded Poisson process at
`--request-rate`, and/or at most `--max-concurrency` requests in flight. Each SSE chunk is one
token arrival (kiln, like vLLM, streams a chunk per generated token); the final usage chunk
checks the count. `--no-stream` asks for whole responses (TTFT is then the E2E latency).

The load comes from `--num-clients` processes (default: one per 64 requests in flight, up to the
CPUs but one), each with its share of the requests, the concurrency and the rate, started at one
instant; their timings share one clock (perf_counter is the system's monotonic clock). Each
reports its CPU time: a client process near 100% of a core is itself a limit, and the record says
so (`client.saturated`), as one httpx process limited the first serve measurements.

Metrics are MEASURING.md's (metrics.py): output tok/s from first submission to last completion,
TTFT, TPOT, ITL, E2E. Needs no local model: the vocabulary size comes from /v1/models.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from kiln.bench.metrics import RequestTiming, throughput_report
from kiln.bench.workload import BenchRequest, benchmark_requests, synthetic_requests


class ServeBenchError(RuntimeError):
    pass


async def _whole_one(client: httpx.AsyncClient, model: str, request: BenchRequest) -> RequestTiming:
    """A non-streaming request: every token 'arrives' with the response."""
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    timing = RequestTiming(submitted=time.perf_counter())
    response = await client.post("/v1/completions", json=payload)
    now = time.perf_counter()
    if response.status_code != 200:
        raise ServeBenchError(f"HTTP {response.status_code}: {response.text[:300]}")
    usage = response.json()["usage"]
    timing.num_prompt_tokens = usage["prompt_tokens"]
    timing.token_times = [now] * usage["completion_tokens"]
    if not timing.token_times:
        raise ServeBenchError("the response has no token")
    return timing


async def _stream_one(
    client: httpx.AsyncClient, model: str, request: BenchRequest
) -> RequestTiming:
    payload = {
        "model": model,
        "prompt": request.prompt_token_ids,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    timing = RequestTiming(submitted=time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise ServeBenchError(f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            now = time.perf_counter()
            event = json.loads(data)
            if "error" in event:
                raise ServeBenchError(f"stream error: {event['error'].get('message')}")
            timing.token_times.extend(now for _ in event.get("choices", ()))
            usage = event.get("usage")
            if usage:
                timing.num_prompt_tokens = usage["prompt_tokens"]
                if usage["completion_tokens"] != len(timing.token_times):
                    raise ServeBenchError(
                        f"{usage['completion_tokens']} tokens generated but "
                        f"{len(timing.token_times)} chunks streamed"
                    )
    if not timing.token_times:
        raise ServeBenchError("the stream ended without a token")
    return timing


@dataclass(frozen=True)
class Arrivals:
    """When requests are sent: all at once (rate inf), or gaps drawn from a gamma distribution
    of mean 1/rate and shape `burstiness` (vLLM's: 1 is a Poisson process, lower is burstier)."""

    rate: float = float("inf")
    burstiness: float = 1.0

    def gap(self, rng: random.Random) -> float:
        return rng.gammavariate(self.burstiness, 1.0 / (self.rate * self.burstiness))

    def split(self, parts: int) -> Arrivals:
        """One of `parts` client processes' share (K gamma streams of rate r/K: the same mean)."""
        return Arrivals(self.rate / parts, self.burstiness)


async def _run(
    base_url: str,
    api_key: str | None,
    model: str,
    requests: list[BenchRequest],
    concurrency: int,
    request_rate: float | Arrivals,
    seed: int,
    stream: bool = True,
) -> tuple[list[RequestTiming], list[str]]:
    arrivals = request_rate if isinstance(request_rate, Arrivals) else Arrivals(request_rate)
    send = _stream_one if stream else _whole_one
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(None, connect=30.0)
    gate = asyncio.Semaphore(concurrency)
    rng = random.Random(seed)
    timings: list[RequestTiming] = []
    failures: list[str] = []
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:

        async def one(request: BenchRequest) -> None:
            async with gate:  # TTFT counts from the send, not from the queue in this client
                try:
                    timings.append(await send(client, model, request))
                except (ServeBenchError, httpx.HTTPError) as exc:
                    failures.append(str(exc))

        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if arrivals.rate != float("inf"):
                await asyncio.sleep(arrivals.gap(rng))
        await asyncio.gather(*tasks)
    return timings, failures


def _encoder(model: str | None) -> Callable[[str], list[int]]:
    """The tokenizer of `model` (a local directory, GGUF file or hub id; None: kiln's default
    model), for a dataset of text: the server is sent token ids, as for random prompts."""
    from kiln.checkpoint.default_model import default_model_path
    from kiln.runtime.model_loader import find_model_source

    tokenizer = find_model_source(model or default_model_path(), "auto").tokenizer
    if tokenizer is None:
        raise ServeBenchError(f"{model}: no tokenizer for --dataset-name sharegpt (--tokenizer)")
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _server_facts(base_url: str, api_key: str | None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    reply = httpx.get(base_url + "/v1/models", headers=headers, timeout=30)
    reply.raise_for_status()
    return reply.json()["data"][0]


def _environment() -> dict:
    try:
        git = ["git", "rev-parse", "--short", "HEAD"], ["git", "status", "--porcelain", "-uno"]
        rev, dirty = (
            subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip()
            for cmd in git
        )
    except (OSError, subprocess.SubprocessError):
        rev, dirty = "unknown", ""
    return {
        "command": " ".join(sys.argv),
        # The client's checkout: the server's code is whatever it was started from.
        "git_revision": (rev or "unknown") + ("-dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "client_host": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs",
        # Client and server often share the host: its load says how noisy the numbers are.
        "load_avg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
    }


def _client_worker(job: dict) -> dict:
    """One client process: wait for the common start, run its share, report its CPU time."""
    delay = job["start_at"] - time.perf_counter()
    if delay > 0:
        time.sleep(delay)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    timings, failures = asyncio.run(
        _run(
            job["base_url"],
            job["api_key"],
            job["model"],
            job["requests"],
            job["concurrency"],
            job["request_rate"],
            job["seed"],
            job["stream"],
        )
    )
    wall = time.perf_counter() - wall0
    return {
        "timings": [(t.submitted, t.token_times, t.num_prompt_tokens) for t in timings],
        "failures": failures,
        "cpu_s": time.process_time() - cpu0,
        "wall_s": wall,
    }


def default_num_clients(concurrency: int) -> int:
    """One client process per 64 requests in flight, up to the CPUs less one (the server's)."""
    return max(1, min(-(-concurrency // 64), (os.cpu_count() or 2) - 1))


def run_load(
    base_url: str,
    api_key: str | None,
    model: str,
    requests: list[BenchRequest],
    concurrency: int,
    request_rate: float | Arrivals,
    seed: int,
    stream: bool,
    num_clients: int,
) -> tuple[list[RequestTiming], list[str], list[dict]]:
    """The load split over `num_clients` processes (in this process when 1)."""
    num_clients = max(1, min(num_clients, len(requests)))
    jobs = [
        {
            "base_url": base_url,
            "api_key": api_key,
            "model": model,
            "requests": requests[i::num_clients],
            "concurrency": max(1, -(-concurrency // num_clients)),
            # K streams of rate r/K sum to one of rate r.
            "request_rate": (
                request_rate if isinstance(request_rate, Arrivals) else Arrivals(request_rate)
            ).split(num_clients),
            "seed": seed + i,
            "stream": stream,
            "start_at": 0.0,
        }
        for i in range(num_clients)
    ]
    if num_clients == 1:
        results = [_client_worker(jobs[0])]
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(num_clients, mp_context=ctx) as pool:
            # Warm the processes (spawn imports httpx) before the common start.
            list(pool.map(time.sleep, [0.0] * num_clients))
            start_at = time.perf_counter() + 1.0
            for job in jobs:
                job["start_at"] = start_at
            results = list(pool.map(_client_worker, jobs))
    timings = [RequestTiming(s, list(tt), n) for r in results for s, tt, n in r["timings"]]
    failures = [f for r in results for f in r["failures"]]
    clients = [
        {
            "cpu_s": r["cpu_s"],
            "wall_s": r["wall_s"],
            "cpu_util": r["cpu_s"] / max(r["wall_s"], 1e-9),
        }
        for r in results
    ]
    return timings, failures, clients


def run_serve_bench(args: argparse.Namespace) -> dict:
    """Run the load, print a table, write the JSON record (if --output-json); returns it."""
    base_url = args.base_url.rstrip("/")
    card = _server_facts(base_url, args.api_key)
    vocab_size = args.vocab_size or card.get("vocab_size")
    if not vocab_size:
        raise ServeBenchError("the server does not say its vocabulary size: pass --vocab-size")
    num_requests = args.num_requests or 64
    concurrency = args.concurrency or num_requests  # no cap: all in flight at once
    stream = not getattr(args, "no_stream", False)
    num_clients = getattr(args, "num_clients", None) or default_num_clients(concurrency)
    # The server's own name for its one model: vLLM's --model (a hub id, say) names the
    # tokenizer a dataset of text needs, which the server may serve under another name.
    model = card["id"]
    requests = benchmark_requests(
        args, num_requests + args.warmup, vocab_size, args.dataset_seed, (),
        lambda: _encoder(getattr(args, "tokenizer", None) or getattr(args, "model", None)),
    )  # fmt: skip
    warmup, requests = requests[: args.warmup], requests[args.warmup :]
    if warmup:
        asyncio.run(_run(base_url, args.api_key, model, warmup, 1, float("inf"), 0, stream))
    rate = Arrivals(args.request_rate, getattr(args, "burstiness", 1.0))
    load = (base_url, args.api_key, model, requests, concurrency, rate)
    timings, failures, clients = run_load(*load, args.dataset_seed, stream, num_clients)
    if not timings:
        raise ServeBenchError(f"every request failed; first error: {failures[:1]}")
    report = throughput_report(timings)
    client = {
        "num_clients": len(clients),
        "processes": clients,
        # A client process busy most of the time is itself a limit on what it measures.
        "saturated": any(c["cpu_util"] > 0.8 for c in clients),
    }
    if getattr(args, "check_client", False):
        # The proof the client is not the bottleneck: one more client process, the same load
        # shape on fresh prompts (the same ones would hit the prefix cache and run faster).
        fresh = synthetic_requests(
            num_requests, args.input_len, args.output_len, vocab_size, args.dataset_seed + 7919
        )
        rerun = (base_url, args.api_key, model, fresh, concurrency, rate)
        more, _, _ = run_load(*rerun, args.dataset_seed + 1, stream, len(clients) + 1)
        if more:
            extra = throughput_report(more)["output_tok_s"]
            client["one_more_client_output_tok_s"] = extra
            client["one_more_client_gain"] = extra / report["output_tok_s"] - 1
    record = {
        "mode": "serve",
        "base_url": base_url,
        "model": model,
        "workload": {
            "num_requests": num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dataset_seed": args.dataset_seed,
            "concurrency": concurrency,
            "request_rate": None if args.request_rate == float("inf") else args.request_rate,
            "burstiness": getattr(args, "burstiness", 1.0),
            "stream": stream,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "num_failed": len(failures),
        "failures": failures[:5],
        "kiln": report,
        "client": client,
        "env": _environment(),
    }
    print(_table(report, len(failures)))
    print(_client_line(client))
    if args.output_json:
        from kiln.bench.report import write_json

        write_json(args.output_json, record)
        print(f"wrote {args.output_json}")
    return record


def _client_line(client: dict) -> str:
    utils = ", ".join(f"{c['cpu_util']:.0%}" for c in client["processes"])
    line = f"client: {client['num_clients']} processes, CPU {utils}"
    if client["saturated"]:
        line += " -- SATURATED: the client may be the limit, add --num-clients"
    if "one_more_client_gain" in client:
        line += f"; one more client: {client['one_more_client_gain']:+.1%} output tok/s"
    return line


def _table(report: dict, num_failed: int) -> str:
    lines = [
        f"requests {report['num_requests']} ok, {num_failed} failed; "
        f"{report['duration_s']:.1f} s; output {report['output_tok_s']:.1f} tok/s; "
        f"total {report['total_tok_s']:.1f} tok/s; {report['request_s']:.2f} req/s",
        f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}",
    ]
    for metric in ("ttft", "tpot", "itl", "e2e"):
        stats = report[metric]
        if stats:
            cells = "".join(f"{stats[k]:>10.1f}" for k in ("mean_ms", "p50_ms", "p90_ms", "p99_ms"))
            lines.append(f"{metric:<6}{cells}")
    return "\n".join(lines)
