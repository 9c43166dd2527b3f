"""Prefill attention over a float8 KV cache, staged (prefill_attention.STAGING: the chunk's keys
and values widened to fp16 by a first kernel) against widened inside the kernel, beside a bf16
cache, at Llama-3.1-8B shapes (GPU). Expectations: benchmarks/prefill_fp8_staging_expected.md.

    PYTHONPATH=. python3 benchmarks/prefill_fp8_staging_sweep.py --out staging.json

Per shape: the bf16 cache and the unstaged float8 kernel at their chosen tiles, the staged one at
its chosen tiles and at every (BLOCK_M, BLOCK_N, num_warps, num_stages) of the grid (each timed
call includes the staging kernel), each output's largest difference from the unstaged one's, and
TFLOP/s of the causal attention's dots.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from prefill_attention_sweep import HEAD_DIM, HEADS, make_inputs, time_ms
from tile_sweep import sweep  # benchmarks/, the script's own folder

from kiln.kernels.triton import prefill_attention as pa

SCALE = HEAD_DIM**-0.5
SHAPES = {  # name: (chunk lengths, cached prefix per chunk)
    "4x2048_fresh": ([2048] * 4, [0] * 4),
    "8x2048_fresh": ([2048] * 8, [0] * 8),  # a 16384-token step of the 2048/128 workload
    "7x2048_1648_after_400": ([2048] * 7 + [1648], [0] * 7 + [400]),
    "1x2048_fresh": ([2048], [0]),
    "1x512_after_6k": ([512], [6144]),
    "8x1000_fresh": ([1000] * 8, [0] * 8),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="prefill_fp8_staging.json")
    p.add_argument("--no-grid", action="store_true", help="only the chosen tiles")
    args = p.parse_args()
    results = []
    for name, (lens, prefixes) in SHAPES.items():
        q, k16, v16, table, qsl, sl, mq, ms = make_inputs(lens, prefixes)
        k8, v8 = k16.to(torch.float8_e4m3fn), v16.to(torch.float8_e4m3fn)
        flops = sum(
            4 * n * (prefix + (n + 1) / 2) * HEAD_DIM * HEADS
            for n, prefix in zip(lens, prefixes, strict=True)
        )

        def run(k=k8, v=v8, q=q, table=table, qsl=qsl, sl=sl, mq=mq, ms=ms):
            return pa.paged_prefill_attention(q, k, v, table, qsl, sl, SCALE, mq, ms)

        pa.STAGING = False
        unstaged = run()
        row = {
            "shape": name,
            "flops": flops,
            "bf16_ms": time_ms(lambda k=k16, v=v16: run(k, v)),
            "fp8_unstaged_ms": time_ms(run),
        }
        pa.STAGING = True
        row["fp8_staged_err"] = (run().float() - unstaged.float()).abs().max().item()
        row["fp8_staged_ms"] = time_ms(run)
        row["staged_tiles"] = list(
            pa._tile_config(HEAD_DIM, mq, HEADS, len(lens), q.device, staged=True)
        )
        if not args.no_grid:
            configs = itertools.product((64, 128), (64, 128), (4, 8), (2, 3))
            row["staged_configs"] = sweep(pa, configs, run, time_ms, unstaged, name)
            row["staged_best"] = min(row["staged_configs"], key=lambda c: c["ms"])
        tflops = {k: flops / row[k] / 1e9 for k in ("bf16_ms", "fp8_unstaged_ms", "fp8_staged_ms")}
        print(
            f"{name}: bf16 {row['bf16_ms']:.3f} ms ({tflops['bf16_ms']:.0f} TFLOP/s), float8 "
            f"unstaged {row['fp8_unstaged_ms']:.3f} ({tflops['fp8_unstaged_ms']:.0f}), staged "
            f"{row['fp8_staged_ms']:.3f} ({tflops['fp8_staged_ms']:.0f}) at "
            f"{row['staged_tiles']}, err {row['fp8_staged_err']:.3g}"
        )
        if "staged_best" in row:
            best = row["staged_best"]
            print(f"    staged best {best['config']} {best['ms']:.3f} ms")
        results.append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
