"""Kernel-level profile of decode steps (GPU): which kernels a step runs and what each costs.

    PYTHONPATH=. python3 benchmarks/profile_decode.py --batch 1 --context 1024 --out prof.txt

Builds the Llama-3.1-8B-shaped dummy engine, prefills `batch` prompts of `context` tokens, then
profiles `--steps` decode steps (CUDA graphs replayed, as in serving) with torch.profiler and
writes the per-kernel table (sorted by total GPU time) and the per-step GPU/wall times.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from kiln.config import EngineConfig
from kiln.engine.llm_engine import LLMEngine
from kiln.sampling_params import SamplingParams


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--quantization", default="none", help="none, fp8-dynamic (weights), ...")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8")
    p.add_argument("--lm-head-quantization", default="none", help="none or fp8 (float8 head)")
    p.add_argument(
        "--prefill",
        action="store_true",
        help="profile the prefill steps of the batch instead (after a warm-up batch of the same "
        "shape, so no compilation is profiled)",
    )
    p.add_argument(
        "--mixed-decodes",
        type=int,
        default=0,
        help="with --prefill: that many sequences decode (at --context) in the profiled prefill "
        "steps, as in a max-throughput run's mixed steps (warmed up on a mixed step first)",
    )
    p.add_argument("--out", default="profile_decode.txt")
    args = p.parse_args()

    config = EngineConfig(
        model=args.model,
        load_format="dummy",
        dtype="bfloat16",
        max_model_len=args.context + 256,
        max_num_seqs=max(args.batch, 1) + args.mixed_decodes,
        # With --mixed-decodes the decodes ride along with a full 8192-token prefill chunk.
        max_num_batched_tokens=max(8192, args.context) + args.mixed_decodes,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        lm_head_quantization=args.lm_head_quantization,
    )
    engine = LLMEngine(config)

    def add_batch(offset: int, max_tokens: int, size: int = args.batch) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i in range(size):
            # Random per (offset, i): no prompt shares a prefix-cache block with another (a
            # shifted arithmetic sequence did: the mixed profile's batch hit the decoders' cache).
            rng = random.Random(f"{offset}-{i}")
            prompt = [rng.randrange(10, 1010) for _ in range(args.context)]
            engine.add_request(prompt, params)

    def prefilling() -> bool:
        return bool(engine.scheduler.waiting) or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
        )

    if args.prefill:  # warm up on other prompts of the same shape, then profile a fresh batch
        if args.mixed_decodes:  # sequences that keep decoding through the profiled steps
            add_batch(3, 240, size=args.mixed_decodes)
            while prefilling():
                engine.step()
        add_batch(1, 2)
        while prefilling() or len(engine.scheduler.running) > args.mixed_decodes:
            engine.step()
        add_batch(2, 200)
    else:
        add_batch(0, 200)
        while prefilling():  # prefill everything, then a few warm decode steps
            engine.step()
        for _ in range(4):
            engine.step()
    torch.cuda.synchronize()
    walls = []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            if args.prefill and not prefilling():
                break
            t0 = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - t0) * 1000)
        torch.cuda.synchronize()
    args.steps = len(walls)
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=40, max_name_column_width=70
    )
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total_us = sum(e.self_device_time_total for e in kernels)
    lines = [
        f"{'prefill' if args.prefill else 'decode'}: batch {args.batch}, context {args.context}, "
        f"{args.mixed_decodes} sequences decoding alongside, "
        f"{args.steps} steps, graphs "
        f"{'off' if args.enforce_eager else 'on'}",
        f"wall per step (ms): median {sorted(walls)[len(walls) // 2]:.3f}, "
        f"mean {sum(walls) / len(walls):.3f}",
        f"GPU kernel time per step: {total_us / args.steps / 1000:.3f} ms over "
        f"{sum(e.count for e in kernels) / args.steps:.0f} kernels",
        "",
        "kernel | calls/step | us/call | ms/step",
    ]
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total):
        lines.append(
            f"{e.key[:90]} | {e.count / args.steps:.1f} | "
            f"{e.self_device_time_total / max(e.count, 1):.2f} | "
            f"{e.self_device_time_total / args.steps / 1000:.3f}"
        )
    text = "\n".join(lines) + "\n\n" + table
    with open(args.out, "w") as f:
        f.write(text)
    print("\n".join(lines[:40]))


if __name__ == "__main__":
    main()
