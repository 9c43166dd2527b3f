"""cuBLAS (F.linear) against kiln's skinny Triton GEMM at batch-1..8 decode shapes of
Llama-3.1-8B (GPU). Each variant is timed as 50 back-to-back calls inside one CUDA graph, so launch
overhead is what a decode graph would see.

    PYTHONPATH=. python3 benchmarks/gemv_sweep.py --out gemv_sweep.json
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
import torch.nn.functional as F

from kiln.kernels.triton.skinny_gemm import skinny_linear

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "down": (4096, 14336),
    "gate_up": (28672, 4096),
}


def graph_time_us(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / reps)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gemv_sweep.json")
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        byte_floor_us = n * k * 2 / 4.25e12 * 1e6
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = F.linear(x, w)
            row = {"shape": name, "m": m, "floor_us": byte_floor_us}
            row["cublas_us"] = graph_time_us(functools.partial(F.linear, x, w))
            best = None
            for bn, bk, warps, stages in itertools.product(
                (16, 32, 64), (128, 256, 512), (4, 8), (3, 4)
            ):
                try:
                    out = skinny_linear(x, w, None, bn, bk, warps, stages)
                    err = (out.float() - ref.float()).abs().max().item()
                    t = graph_time_us(
                        functools.partial(skinny_linear, x, w, None, bn, bk, warps, stages)
                    )
                except Exception as exc:  # out of shared memory etc.
                    print(name, m, bn, bk, warps, stages, "failed:", type(exc).__name__)
                    continue
                if best is None or t < best[0]:
                    best = (t, bn, bk, warps, stages, err)
            row["triton_us"], *cfg, row["max_abs_err"] = best
            row["triton_config"] = cfg
            row["speedup"] = row["cublas_us"] / row["triton_us"]
            print(
                f"{name:8s} m={m} floor {byte_floor_us:6.1f} us  cublas {row['cublas_us']:6.1f}  "
                f"triton {row['triton_us']:6.1f} {cfg} err {row['max_abs_err']:.3g}"
            )
            results.append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
