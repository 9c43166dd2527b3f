"""Orchestrates one `kiln bench` run: workload, kiln, the baseline, the report."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import tempfile
import time
from collections.abc import Callable

import torch

from kiln.bench.dummy_lora import dummy_adapters
from kiln.bench.hf_baseline import hf_decode_rate, load_hf_model, run_hf
from kiln.bench.metrics import throughput_report
from kiln.bench.offline import run_kiln
from kiln.bench.report import (
    engine_config_record,
    environment,
    format_table,
    measure_copy_bandwidth,
    write_json,
)
from kiln.bench.roofline import decode_step_bytes
from kiln.bench.workload import BenchRequest, benchmark_requests, synthetic_requests
from kiln.checkpoint.default_model import default_model_path
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.occupancy import Occupancy
from kiln.errors import KilnError
from kiln.kernel_cache import compile_watch
from kiln.lora.request import LoRARequest
from kiln.runtime.model_runner import TRACE_COLUMNS


def run_bench(args: argparse.Namespace, config: EngineConfig) -> dict:
    start = time.perf_counter()
    engine = LLMEngine(config)
    startup_s = time.perf_counter() - start
    num_requests = args.num_requests or (64 if args.mode == "throughput" else 3)
    requests = benchmark_requests(
        args,
        num_requests,
        engine.model_config.vocab_size,
        args.dataset_seed,
        engine.eos_token_ids,
        lambda: _encoder(engine),
    )
    record = _setup_record(args, config, engine, requests, startup_s)
    print(f"memory plan: {record['memory_plan']['summary']}")
    with tempfile.TemporaryDirectory(prefix="kiln-bench-lora-") as lora_dir:
        loras = None
        if args.lora_adapters:
            loras = dummy_adapters(
                engine.model_config, args.lora_adapters, args.lora_rank, lora_dir
            )
            record["lora"] = {"adapters": args.lora_adapters, "rank": args.lora_rank}
        _run_kiln_timed(args, engine, requests, record, loras)
    if args.baseline == "hf":
        model_path = config.model or default_model_path()
        dtype, device = getattr(torch, engine.dtype), torch.device(engine.device)
        # Free kiln's weights, KV cache and graphs before the baseline loads: both at once would
        # not fit an 8B model next to a KV cache planned for most of the card.
        del engine
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        record["hf"] = _run_hf_baseline(args, load_hf_model(model_path, dtype, device), requests)
        record["speedup_vs_hf"] = _speedups(record)

    print(_table(record))
    if args.output_json:
        write_json(args.output_json, record)
        print(f"wrote {args.output_json}")
    return record


def _encoder(engine: LLMEngine) -> Callable[[str], list[int]]:
    """The engine's tokenizer's encode (a dataset of text needs one)."""
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise KilnError("--dataset-name sharegpt needs a model with a tokenizer")
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def _setup_record(
    args: argparse.Namespace,
    config: EngineConfig,
    engine: LLMEngine,
    requests: list[BenchRequest],
    startup_s: float,
) -> dict:
    """What was run, on what, with which plan: the record's fields before any timing."""
    stats = engine.executor.stats()
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    record: dict = {
        "mode": args.mode,
        "model": engine.model_description,
        "dtype": engine.dtype,
        "workload": {
            "num_requests": len(requests),
            "input_len": args.input_len,
            "output_len": args.output_len,
            "dataset_seed": args.dataset_seed,
            "dataset": getattr(args, "dataset_path", None) or "random",
            "concurrency": args.concurrency if args.mode == "throughput" else 1,
        },
        "engine_config": engine_config_record(config),
        "memory_plan": {
            **stats.memory_plan.as_dict(longest),
            "summary": stats.memory_plan.describe(longest),
        },
        "startup_s": startup_s,
        "env": environment(torch.device(engine.device)),
    }
    if stats.cuda_graphs is not None:
        record["cuda_graphs"] = stats.cuda_graphs
    return record


def _run_kiln_timed(
    args: argparse.Namespace,
    engine: LLMEngine,
    requests: list[BenchRequest],
    record: dict,
    loras: list[LoRARequest] | None = None,
) -> None:
    """Warm up on other prompts, then the timed run with per-step timings, into `record`."""
    progress = not args.no_progress
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
        run_kiln(engine, warmup, progress=False, loras=loras)
    concurrency = args.concurrency if args.mode == "throughput" else 1
    compiled_before = len(compile_watch.WATCH.compiles)
    scheduler = engine.scheduler
    scheduler.occupancy = Occupancy()  # the timed run's, not the warmup's
    preempted_before = scheduler.num_preemptions_total
    engine.executor.enable_step_timing()  # a few clock reads per step: host vs GPU time
    step_clock: dict = {}
    kiln_report = throughput_report(
        run_kiln(engine, requests, concurrency, progress, step_clock, loras)
    )
    record["kiln"] = kiln_report
    record["kv_occupancy"] = _kv_occupancy(engine, requests, preempted_before)
    # Triton kernels this process compiled during the timed run (each stalled a step), and
    # whether the watch ran (it needs a GPU and Triton; a multi-process engine's ranks have
    # their own).
    record["kernel_compiles"] = {
        "watched": compile_watch.WATCH.active,
        "timed_run": compile_watch.WATCH.since(compiled_before),
    }
    timing = engine.executor.stats().step_timing
    assert timing is not None  # enabled above
    record["step_profile"] = _step_profile(timing, step_clock)
    # Every step, for distributions: the runner's phases and the whole engine step's wall time.
    trace, walls = timing.get("trace", []), step_clock.get("walls", [])
    record["step_trace"] = {
        "columns": [*TRACE_COLUMNS, "engine_step"],
        "rows": [[*row, wall] for row, wall in zip(trace, walls)]
        if len(trace) == len(walls)
        else [],
    }
    if args.mode == "latency":
        record["kiln"]["decode_tok_s"] = 1000.0 / kiln_report["tpot"]["mean_ms"]
        record["roofline"] = _decode_roofline(engine, requests, kiln_report)


def _kv_occupancy(engine: LLMEngine, requests: list[BenchRequest], preempted_before: int) -> dict:
    """The most sequences the timed run held at once with their whole context in the cache,
    beside the memory plan's count of sequences of the longest request's length that fit (and
    with every layer keeping its whole context: what a windowed layer group saves)."""
    plan, scheduler = engine.memory_plan, engine.scheduler
    longest = max(len(r.prompt_token_ids) + r.output_len for r in requests)
    return {
        **dataclasses.asdict(scheduler.occupancy),
        "kv_blocks": plan.num_blocks,
        "preemptions": scheduler.num_preemptions_total - preempted_before,
        "context_len": longest,
        "plan_sequences": plan.max_concurrent_seqs(longest),
        "plan_sequences_every_layer": plan.sequences_keeping_every_layer(longest),
    }


def _run_hf_baseline(
    args: argparse.Namespace, hf_model: object, requests: list[BenchRequest]
) -> dict:
    """HF's share of the requests: it is slow, and its static batches reach steady state in one
    batch. Default: one batch (throughput) or one request (latency)."""
    progress = not args.no_progress
    hf_num = getattr(args, "hf_num_requests", None)
    if args.mode == "throughput":
        batch = args.hf_batch_size or args.concurrency or len(requests)
        hf = throughput_report(run_hf(hf_model, requests[: hf_num or batch], batch, progress))
        # generate returns a batch's tokens together: per-token gaps are not observable.
        del hf["tpot"], hf["itl"]
        hf["note"] = "TTFT and E2E are each static batch's completion time"
        hf["batch_size"] = batch
        return hf
    hf_requests = requests[: hf_num or 1]
    rates = [hf_decode_rate(hf_model, r.prompt_token_ids, r.output_len) for r in hf_requests]
    return {
        "num_requests": len(hf_requests),
        "decode_tok_s": sum(r["decode_tok_s"] for r in rates) / len(rates),
        "ttft": {"mean_ms": sum(r["ttft_ms"] for r in rates) / len(rates)},
    }


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


def _decode_roofline(engine: LLMEngine, requests: list[BenchRequest], report: dict) -> dict:
    """Bytes one decode step must read (kiln.bench.roofline: the weights but the embedding table
    and the experts no token picks, plus the context's KV) over the measured copy bandwidth: the
    floor on time per output token. Latency mode decodes one sequence at a time: batch 1."""
    plan, cfg = engine.memory_plan, engine.model_config
    embedding = 0
    if not cfg.tie_word_embeddings:  # untied: the table is only gathered from, never streamed
        embedding = cfg.vocab_size * cfg.hidden_size * getattr(torch, engine.dtype).itemsize
    mean_context = sum(len(r.prompt_token_ids) + r.output_len / 2 for r in requests) / len(requests)
    kv_bytes = plan.kv_bytes_read(mean_context)  # (windowed layers: their window's)
    step = decode_step_bytes(
        cfg, plan.weight_bytes, plan.expert_weight_bytes, embedding, kv_bytes, batch=1
    )
    bandwidth = measure_copy_bandwidth(torch.device(engine.device))
    floor_ms = step.total_bytes / bandwidth * 1000
    return {
        **step.as_dict(),
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
    rows: list[tuple[str, ...]] = [("metric", "kiln", "hf", "kiln / hf")]

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
    if hf is None:  # no baseline: no empty hf and ratio columns
        rows = [r[:2] for r in rows]
    table = format_table(rows)
    if "spec_decode" in kiln:
        sd = kiln["spec_decode"]
        table += (
            f"\nspeculative decoding: {sd['num_accepted_tokens']:,} of {sd['num_draft_tokens']:,}"
            f" drafts accepted ({sd['acceptance_rate']:.0%}), mean acceptance length "
            f"{sd['mean_acceptance_length']:.2f} tokens per verification step"
        )
    if "roofline" in record:
        r = record["roofline"]
        if r.get("experts_per_layer"):
            table += (
                f"\nmixture of experts: {r['active_parameters'] / 1e9:.2f}B of "
                f"{r['total_parameters'] / 1e9:.2f}B parameters active; a step reads "
                f"{r['experts_per_layer']:.1f} experts a layer ({r['expert_bytes'] / 1e9:.2f} GB)"
                f" + {r['non_expert_bytes'] / 1e9:.2f} GB other weights + "
                f"{r['kv_bytes'] / 1e9:.2f} GB KV"
            )
        table += (
            f"\ndecode roofline: {r['bytes_per_step'] / 1e9:.2f} GB/step at "
            f"{r['copy_bandwidth_gb_s']:.0f} GB/s -> {r['floor_ms_per_token']:.2f} ms/token; "
            f"achieved {r['achieved_fraction']:.0%}"
        )
    if record["mode"] == "throughput" and "kv_occupancy" in record:
        table += _occupancy_line(record["kv_occupancy"])
    table += _compile_warning(record.get("kernel_compiles", {}).get("timed_run", []))
    return table + _host_bound_warning(record.get("step_profile", {}))


def _occupancy_line(occ: dict) -> str:
    return (
        f"\nKV cache: at most {occ['peak_sequences']} sequences at once with their whole context "
        f"({occ['blocks_at_peak']:,} of {occ['kv_blocks']:,} blocks); the plan fits "
        f"{occ['plan_sequences']} x {occ['context_len']} ({occ['plan_sequences_every_layer']} if "
        f"every layer kept its whole context); {occ['peak_running']} running at most, "
        f"{occ['preemptions']} preemptions"
    )


def _compile_warning(compiles: list[dict]) -> str:
    if not compiles:
        return ""
    names = sorted({c["kernel"].rsplit(":", 1)[-1] for c in compiles})
    return (
        f"\nwarning: {len(compiles)} Triton kernel variant(s) compiled during the timed run "
        f"({', '.join(names)}): each stalled a step (record: kernel_compiles)"
    )


# Below this share of a CUDA-graph decode step the GPU waits on the host: the run then measures
# scheduling and output processing, not the GPU (an engine whose detokenizer went quadratic ran
# at 36%, GPU-bound runs at 0.99-1.0).
HOST_BOUND_FRACTION = 0.8


def _host_bound_warning(step_profile: dict) -> str:
    graph = step_profile.get("graph", {})
    busy = graph.get("gpu_busy_fraction")
    if busy is None or busy >= HOST_BOUND_FRACTION:
        return ""
    return (
        f"\nwarning: host-bound: the GPU was busy {busy:.0%} of a decode step "
        f"({graph['engine_step_ms']:.1f} ms, {graph['outside_runner_ms']:.1f} of them outside the "
        "model runner: scheduling and output processing); this measures the host, not the GPU"
    )
