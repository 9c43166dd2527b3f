"""Orchestrates one `kiln bench` run: workload, kiln, the baseline, the report."""

from __future__ import annotations

import argparse

from kiln.bench.hf_baseline import hf_decode_rate, load_hf_model, run_hf
from kiln.bench.metrics import throughput_report
from kiln.bench.offline import run_kiln
from kiln.bench.report import environment, format_table, measure_copy_bandwidth, write_json
from kiln.bench.workload import synthetic_requests
from kiln.build.default_model import default_model_path
from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine


def run_bench(args: argparse.Namespace, config: EngineConfig) -> dict:
    engine = LLMEngine(config)
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
            "weight_gib": plan.weight_bytes / 2**30,
            "kv_blocks": plan.num_blocks,
            "kv_tokens": plan.kv_tokens,
            "summary": plan.describe(max(len(r.prompt_token_ids) + r.output_len for r in requests)),
        },
        "env": environment(engine.device),
    }
    print(f"memory plan: {record['memory_plan']['summary']}")

    if args.warmup:
        run_kiln(engine, requests[: args.warmup], progress=False)
    concurrency = args.concurrency if args.mode == "throughput" else 1
    kiln_report = throughput_report(run_kiln(engine, requests, concurrency, progress))
    record["kiln"] = kiln_report
    if args.mode == "latency":
        record["kiln"]["decode_tok_s"] = 1000.0 / kiln_report["tpot"]["mean_ms"]
        record["roofline"] = _decode_roofline(engine, requests, kiln_report)

    if args.baseline == "hf":
        model_path = config.model or default_model_path()
        hf_model = load_hf_model(model_path, engine.dtype, engine.device)
        del engine  # free the KV cache before the baseline runs
        if args.mode == "throughput":
            batch = args.hf_batch_size or args.concurrency or len(requests)
            record["hf"] = throughput_report(run_hf(hf_model, requests, batch, progress))
            record["hf"]["batch_size"] = batch
        else:
            rates = [hf_decode_rate(hf_model, r.prompt_token_ids, r.output_len) for r in requests]
            record["hf"] = {
                "decode_tok_s": sum(r["decode_tok_s"] for r in rates) / len(rates),
                "ttft": {"mean_ms": sum(r["ttft_ms"] for r in rates) / len(rates)},
            }
        record["speedup_vs_hf"] = _speedups(record)

    print(_table(record))
    if args.output_json:
        write_json(args.output_json, record)
        print(f"wrote {args.output_json}")
    return record


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
