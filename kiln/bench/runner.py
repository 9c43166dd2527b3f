"""Orchestrates one `kiln bench` run: workload, kiln, the baseline, the report."""

from __future__ import annotations

import argparse
import gc
import time

import torch

from kiln.bench.hf_baseline import hf_decode_rate, load_hf_model, run_hf
from kiln.bench.metrics import throughput_report
from kiln.bench.offline import run_kiln
from kiln.bench.report import environment, format_table, measure_copy_bandwidth, write_json
from kiln.bench.workload import synthetic_requests
from kiln.checkpoint.default_model import default_model_path
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.runtime.model_runner import TRACE_COLUMNS


def run_bench(args: argparse.Namespace, config: EngineConfig) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(config)
    startup_s = time.perf_counter() - start
    num_requests = args.num_requests or (64 if args.mode == "throughput" else 3)
    requests = synthetic_requests(
        num_requests,
        args.input_len,
        args.output_len,
        engine.model_config.vocab_size,
        seed=args.dataset_seed,
        avoid_ids=engine.eos_token_ids,
    )
    progress = not args.no_progress
    plan = engine.memory_plan
    record: dict = {
        "mode": args.mode,
        "model": engine.model_description,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "workload": {
            "num_requests": num_requests,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dataset_seed": args.dataset_seed,
            "concurrency": args.concurrency if args.mode == "throughput" else 1,
        },
        "engine_config": {k: v for k, v in vars(config).items() if v is not None},
        "memory_plan": {
            **plan.as_dict(),
            "summary": plan.describe(max(len(r.prompt_token_ids) + r.output_len for r in requests)),
        },
        "startup_s": startup_s,
        "env": environment(engine.device),
    }
    graphs = engine.runner.graphs
    if graphs is not None:
        record["cuda_graphs"] = {
            "num_graphs": graphs.num_graphs,
            "batch_sizes": graphs.batch_sizes,
            "capture_s": graphs.capture_seconds,
            "pool_gib": graphs.pool_bytes / 2**30,
        }
    print(f"memory plan: {record['memory_plan']['summary']}")

    if args.warmup:
        # Other prompts than the timed ones (a prefix-cache hit would flatter TTFT), and short
        # outputs: enough to compile and tune every kernel shape, mixed prefill+decode steps too.
        warmup = synthetic_requests(
            args.warmup,
            args.input_len,
            "16",
            engine.model_config.vocab_size,
            seed=args.dataset_seed + 1,
            avoid_ids=engine.eos_token_ids,
        )
        run_kiln(engine, warmup, progress=False)
    concurrency = args.concurrency if args.mode == "throughput" else 1
    engine.runner.step_timing = {}  # a few clock reads per step: host vs GPU time, recorded
    step_clock: dict = {}
    kiln_report = throughput_report(run_kiln(engine, requests, concurrency, progress, step_clock))
    record["kiln"] = kiln_report
    record["step_profile"] = _step_profile(engine.runner.step_timing, step_clock)
    # Every step, for distributions: the runner's phases and the whole engine step's wall time.
    record["step_trace"] = {
        "columns": [*TRACE_COLUMNS, "engine_step"],
        "rows": [
            [*row, wall]
            for row, wall in zip(engine.runner.step_timing.get("trace", []), step_clock["walls"])
        ]
        if len(engine.runner.step_timing.get("trace", [])) == len(step_clock.get("walls", []))
        else [],
    }
    if args.mode == "latency":
        record["kiln"]["decode_tok_s"] = 1000.0 / kiln_report["tpot"]["mean_ms"]
        record["roofline"] = _decode_roofline(engine, requests, kiln_report)

    if args.baseline == "hf":
        model_path = config.model or default_model_path()
        dtype, device = engine.dtype, engine.device
        # Free kiln's weights, KV cache and graphs before the baseline loads: both at once would
        # not fit an 8B model next to a KV cache planned for most of the card.
        del engine, graphs
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf_model = load_hf_model(model_path, dtype, device)
        # HF's share of the requests: it is slow, and its static batches reach steady state in
        # one batch. Default: one batch (throughput) or one request (latency).
        hf_num = getattr(args, "hf_num_requests", None)
        if args.mode == "throughput":
            batch = args.hf_batch_size or args.concurrency or len(requests)
            hf_requests = requests[: hf_num or batch]
            hf = throughput_report(run_hf(hf_model, hf_requests, batch, progress))
            # generate returns a batch's tokens together: per-token gaps are not observable.
            del hf["tpot"], hf["itl"]
            hf["note"] = "TTFT and E2E are each static batch's completion time"
            hf["batch_size"] = batch
            record["hf"] = hf
        else:
            hf_requests = requests[: hf_num or 1]
            rates = [
                hf_decode_rate(hf_model, r.prompt_token_ids, r.output_len) for r in hf_requests
            ]
            record["hf"] = {
                "num_requests": len(hf_requests),
                "decode_tok_s": sum(r["decode_tok_s"] for r in rates) / len(rates),
                "ttft": {"mean_ms": sum(r["ttft_ms"] for r in rates) / len(rates)},
            }
        record["speedup_vs_hf"] = _speedups(record)

    print(_table(record))
    if args.output_json:
        write_json(args.output_json, record)
        print(f"wrote {args.output_json}")
    return record


def _step_profile(runner_timing: dict, step_clock: dict) -> dict:
    """Per-step means (ms), over all steps and per kind (graph: decode-only steps replayed from a
    CUDA graph; eager: the rest): where the host spends a step, and how busy the GPU was.
    engine_step is the whole engine.step(); outside_runner is scheduling, the scheduler's update
    and output processing; gpu is device time from the step's first kernel to its sampled ids."""
    names = ("prepare", "forward_launch", "sample_launch", "sync_wait", "finish", "gpu")
    profile: dict = {}
    for kind in ("", "graph_", "eager_"):
        steps = runner_timing.get(kind + "steps", 0)
        if not steps:
            continue
        part = {
            n + "_ms": runner_timing[kind + n] / steps * 1000
            for n in names
            if kind + n in runner_timing
        }
        part["steps"] = int(steps)
        wall_steps = step_clock.get(kind + "steps", 0)
        if wall_steps:
            runner_ms = sum(v for k, v in part.items() if k.endswith("_ms") and k != "gpu_ms")
            part["engine_step_ms"] = step_clock[kind + "wall"] / wall_steps * 1000
            part["outside_runner_ms"] = part["engine_step_ms"] - runner_ms
            if "gpu_ms" in part:
                part["gpu_busy_fraction"] = part["gpu_ms"] / part["engine_step_ms"]
        profile[kind.rstrip("_") or "all"] = part
    return profile


def _decode_roofline(engine: LLMEngine, requests, report: dict) -> dict:
    """Bytes one decode step must read (weights but the embedding table, plus the context's KV)
    over the measured copy bandwidth: the floor on time per output token."""
    model = engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weight_bytes -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    if model.lm_head is None:  # tied: the table is read once as the output projection
        weight_bytes += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    mean_context = sum(len(r.prompt_token_ids) + r.output_len / 2 for r in requests) / len(requests)
    kv_bytes = engine.memory_plan.bytes_per_block / engine.memory_plan.block_size * mean_context
    bandwidth = measure_copy_bandwidth(engine.device)
    floor_ms = (weight_bytes + kv_bytes) / bandwidth * 1000
    return {
        "bytes_per_step": weight_bytes + kv_bytes,
        "copy_bandwidth_gb_s": bandwidth / 1e9,
        "floor_ms_per_token": floor_ms,
        "achieved_fraction": floor_ms / report["tpot"]["mean_ms"],
    }


def _speedups(record: dict) -> dict:
    kiln, hf = record["kiln"], record["hf"]
    if record["mode"] == "throughput":
        return {"output_tok_s": kiln["output_tok_s"] / hf["output_tok_s"]}
    return {"decode_tok_s": kiln["decode_tok_s"] / hf["decode_tok_s"]}


def _table(record: dict) -> str:
    kiln, hf = record["kiln"], record.get("hf")
    rows = [("metric", "kiln", "hf", "kiln / hf")]

    def row(name: str, k: float | None, h: float | None, ratio: bool = True) -> None:
        fmt = lambda v: "-" if v is None else f"{v:,.1f}"
        r = "-" if not (ratio and k and h) else f"{k / h:.2f}x"
        rows.append((name, fmt(k), fmt(h), r))

    if record["mode"] == "throughput":
        row("output tok/s", kiln["output_tok_s"], hf and hf["output_tok_s"])
        row("total tok/s", kiln["total_tok_s"], hf and hf["total_tok_s"])
        row("requests/s", kiln["request_s"], hf and hf["request_s"])
    else:
        row("decode tok/s", kiln["decode_tok_s"], hf and hf["decode_tok_s"])
    for metric in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean_ms", "p50_ms", "p90_ms", "p99_ms"):
            if stat in kiln.get(metric, {}):
                theirs = (hf or {}).get(metric, {}).get(stat)
                row(f"{metric} {stat}", kiln[metric][stat], theirs, ratio=False)
    table = format_table(rows)
    if "roofline" in record:
        r = record["roofline"]
        table += (
            f"\ndecode roofline: {r['bytes_per_step'] / 1e9:.2f} GB/step at "
            f"{r['copy_bandwidth_gb_s']:.0f} GB/s -> {r['floor_ms_per_token']:.2f} ms/token; "
            f"achieved {r['achieved_fraction']:.0%}"
        )
    return table
