"""`kiln bench serve`: load on an OpenAI-compatible server, timed per token as the client sees it.

Streams /v1/completions with synthetic random token-id prompts (trtllm-bench's workload; EOS
ignored, greedy), at most `--concurrency` requests in flight, arrivals either all at once or a
seeded Poisson process at `--request-rate`. Each SSE chunk is one token arrival (kiln, like vLLM,
streams a chunk per generated token); the final usage chunk checks the count. Metrics are
MEASURING.md's (metrics.py): output tok/s from first submission to last completion, TTFT, TPOT,
ITL, E2E. Needs no local model: the vocabulary size comes from /v1/models (or --vocab-size).
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

import httpx

from kiln.bench.metrics import RequestTiming, throughput_report
from kiln.bench.workload import BenchRequest, synthetic_requests


class ServeBenchError(RuntimeError):
    pass


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


async def _run(
    base_url: str,
    api_key: str | None,
    model: str,
    requests: list[BenchRequest],
    concurrency: int,
    request_rate: float,
    seed: int,
) -> tuple[list[RequestTiming], list[str]]:
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
                    timings.append(await _stream_one(client, model, request))
                except (ServeBenchError, httpx.HTTPError) as exc:
                    failures.append(str(exc))

        tasks = []
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.expovariate(request_rate))
        await asyncio.gather(*tasks)
    return timings, failures


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


def run_serve_bench(args: argparse.Namespace) -> dict:
    """Run the load, print a table, write the JSON record (if --output-json); returns it."""
    base_url = args.base_url.rstrip("/")
    card = _server_facts(base_url, args.api_key)
    vocab_size = args.vocab_size or card.get("vocab_size")
    if not vocab_size:
        raise ServeBenchError("the server does not say its vocabulary size: pass --vocab-size")
    concurrency = args.concurrency or 1
    num_requests = args.num_requests or 64
    requests = synthetic_requests(
        num_requests + args.warmup, args.input_len, args.output_len, vocab_size, args.dataset_seed
    )
    warmup, requests = requests[: args.warmup], requests[args.warmup :]
    model = card["id"]
    if warmup:
        asyncio.run(_run(base_url, args.api_key, model, warmup, 1, float("inf"), 0))
    timings, failures = asyncio.run(
        _run(
            base_url,
            args.api_key,
            model,
            requests,
            concurrency,
            args.request_rate,
            args.dataset_seed,
        )
    )
    if not timings:
        raise ServeBenchError(f"every request failed; first error: {failures[:1]}")
    report = throughput_report(timings)
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
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "num_failed": len(failures),
        "failures": failures[:5],
        "kiln": report,
        "env": _environment(),
    }
    print(_table(report, len(failures)))
    if args.output_json:
        from kiln.bench.report import write_json

        write_json(args.output_json, record)
        print(f"wrote {args.output_json}")
    return record


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
