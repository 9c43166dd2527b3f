"""The fused small-batch linear kernels against the unfused ops they replace, at the batch-1..8
decode shapes of Llama-3.1-8B (GPU), plus a tile sweep of the fused kernel.

    PYTHONPATH=. python3 benchmarks/small_batch_linear_sweep.py --out sweep.json

Per projection, "plain" is the kernel with nothing fused into it (what the fused ops cost),
"unfused" is what a decode layer ran before: the Triton RMSNorm (with residual add), then cuBLAS
(F.linear, with its split-K reduce where it picks one), then for gate_up the SiLU-mul kernel.
Each variant is timed as back-to-back calls inside one CUDA graph (launch gaps included, as in a
decode graph), cycling over enough copies of the weight that every call reads it from HBM.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F
from tile_sweep import graph_time_ms, sweep  # benchmarks/, the script's own folder

from kiln.kernels.triton import small_batch_linear, small_batch_tiles
from kiln.kernels.triton.rms_norm import fused_add_rms_norm
from kiln.kernels.triton.silu_mul import silu_and_mul

HIDDEN, INTERMEDIATE = 4096, 14336
# The fused ops -> the kernel that runs them at one row (small_batch_tiles' names).
KERNEL = {"add_norm": "norm_linear", "add_norm_silu_mul": "norm_linear_silu_mul", "none": "linear"}
SHAPES = {  # name: (N, K, the ops fused in)
    "qkv": (6144, HIDDEN, "add_norm"),
    "o_proj": (HIDDEN, HIDDEN, "none"),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, "add_norm_silu_mul"),
    "down": (HIDDEN, INTERMEDIATE, "none"),
}
COPY_BANDWIDTH = 4.25e12  # bytes/s, the H200's measured device-to-device copy (FACTS.md)
L2_BYTES = 50 * 2**20


@dataclasses.dataclass
class Inputs:
    fused_ops: str  # "add_norm" (before the matmul), "add_norm_silu_mul" (and after) or "none"
    x: torch.Tensor
    residual: torch.Tensor
    norm_weight: torch.Tensor


def unfused_call(a: Inputs, w: torch.Tensor) -> torch.Tensor:
    if a.fused_ops == "none":
        return F.linear(a.x, w)
    out = F.linear(fused_add_rms_norm(a.x, a.residual, a.norm_weight, 1e-5)[0], w)
    return silu_and_mul(out) if a.fused_ops == "add_norm_silu_mul" else out


def fused_call(a: Inputs, w: torch.Tensor) -> torch.Tensor:
    norm_args = (a.x, a.residual, a.norm_weight, 1e-5, w)
    if a.fused_ops == "add_norm":
        return small_batch_linear.add_rms_norm_linear(*norm_args)[0]
    if a.fused_ops == "add_norm_silu_mul":
        return small_batch_linear.add_rms_norm_linear_silu_mul(*norm_args)[0]
    return small_batch_linear.linear(a.x, w)


def time_all_copies_ms(fn: Callable, weights: list[torch.Tensor], *unused: object) -> float:
    """Mean ms per call of fn over every weight copy in turn (the sweep passes its run too)."""
    return graph_time_ms([functools.partial(fn, w) for w in weights], reps=4, replays=5)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--out", default="small_batch_linear_sweep.json")
    args = p.parse_args()
    torch.manual_seed(0)
    bf16, dev = torch.bfloat16, "cuda"
    results = []
    for name in args.shapes:
        n, k, fused_ops = SHAPES[name]
        weight_bytes = n * k * 2
        copies = max(2, -(-3 * L2_BYTES // weight_bytes))  # cycle past the L2 every call
        weights = [0.02 * torch.randn(n, k, device=dev, dtype=bf16) for _ in range(copies)]
        norm_weight = 1 + 0.1 * torch.randn(k, device=dev, dtype=bf16)
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=bf16)
            residual = torch.randn(rows, k, device=dev, dtype=bf16)
            inputs = Inputs(fused_ops, x, residual, norm_weight)
            unfused = functools.partial(unfused_call, inputs)
            fused = functools.partial(fused_call, inputs)
            reference = unfused(weights[0])
            row = {
                "shape": name,
                "n": n,
                "k": k,
                "fused_ops": fused_ops,
                "rows": rows,
                "weight_copies": copies,
                "bytes_floor_us": weight_bytes / COPY_BANDWIDTH * 1e6,
                "unfused_us": time_all_copies_ms(unfused, weights) * 1000,
                "fused_us": time_all_copies_ms(fused, weights) * 1000,
                # The same weight stream with nothing fused before it: the prologue's cost.
                "plain_us": time_all_copies_ms(
                    functools.partial(fused_call, dataclasses.replace(inputs, fused_ops="none")),
                    weights,
                )
                * 1000,
                "default_config": list(
                    small_batch_tiles.tile_config(KERNEL[fused_ops], n, k, x.device, 2, rows)
                ),
                "max_abs_err_vs_unfused": (fused(weights[0]) - reference).abs().max().item(),
            }
            row["speedup"] = row["unfused_us"] / row["fused_us"]
            results.append(row)
            print(
                f"{name:8s} rows={rows}: floor {row['bytes_floor_us']:6.1f} us, unfused "
                f"{row['unfused_us']:6.1f}, fused {row['fused_us']:6.1f} "
                f"{row['default_config']}, plain {row['plain_us']:6.1f}, "
                f"err {row['max_abs_err_vs_unfused']:.3g}",
                flush=True,
            )
            if rows != 1:
                continue  # the tiles are swept where the fused ops run: one row
            configs = itertools.product((32, 64), (128, 256, 512), (4, 8), (3, 4))
            tiles = sweep(
                small_batch_tiles,
                (small_batch_tiles.Tiles(*config) for config in configs),
                functools.partial(fused, weights[0]),
                functools.partial(time_all_copies_ms, fused, weights),
                reference,
                f"{name} rows={rows}",
                attribute="tile_config",
            )
            tiles.sort(key=lambda t: t["ms"])
            row["best_tiles"] = tiles[:5]
            print(f"  best tiles: {[(round(t['ms'] * 1000, 1), t['config']) for t in tiles[:3]]}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
