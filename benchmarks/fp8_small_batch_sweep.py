"""The float8 small-batch kernels against bf16's and against the FP8 GEMM path, at the batch-1/8
decode shapes of Llama-3.1-8B (GPU), plus a tile sweep of the float8 kernels at one row.

    PYTHONPATH=. python3 benchmarks/fp8_small_batch_sweep.py --out fp8_small_batch.json

Per projection: "bf16" is the bf16 fused op (norm + projection + epilogue), "fp8" the same op on
float8 weights with dynamic activations (the norm, quantization, projection and epilogue in one
kernel at one row), "fp8_gemm" what FP8 ran before at these rows (the norm kernel, quantize_fp8,
_scaled_mm, the scale epilogue, and SiLU-mul's kernel for gate_up). Timed as back-to-back calls in
one CUDA graph over enough weight copies that each call reads its weight from HBM.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch
from tile_sweep import graph_time_ms, sweep  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels.triton import fp8_gemm
from kiln.kernels.triton import small_batch_linear as sbl
from kiln.kernels.triton.rms_norm import fused_add_rms_norm
from kiln.kernels.triton.silu_mul import silu_and_mul

HIDDEN, INTERMEDIATE = 4096, 14336
SHAPES = {  # name: (N, K, the ops fused in)
    "qkv": (6144, HIDDEN, "add_norm"),
    "o_proj": (HIDDEN, HIDDEN, "none"),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, "add_norm_silu_mul"),
    "down": (HIDDEN, INTERMEDIATE, "none"),
}
COPY_BANDWIDTH = 4.25e12  # bytes/s, the H200's measured device-to-device copy (FACTS.md)
L2_BYTES = 50 * 2**20


def fused(fused_ops, x, residual, nw, w, ws=None):
    """The op a decode layer calls for this projection (ws: float8 weight scales)."""
    if fused_ops == "add_norm":
        return sbl.add_rms_norm_linear(x, residual, nw, 1e-5, w, None, ws, None)[0]
    if fused_ops == "add_norm_silu_mul":
        return sbl.add_rms_norm_linear_silu_mul(x, residual, nw, 1e-5, w, ws, None)[0]
    return sbl.linear(x, w) if ws is None else sbl.fp8_linear(x, w, ws, None)


def gemm_path(fused_ops, x, residual, nw, w, ws):
    h = x if fused_ops == "none" else fused_add_rms_norm(x, residual, nw, 1e-5)[0]
    out = fp8_gemm.fp8_linear(h, w, ws, None)
    return silu_and_mul(out) if fused_ops == "add_norm_silu_mul" else out


def time_us(fn, weights) -> float:
    calls = [functools.partial(fn, *w) if isinstance(w, tuple) else functools.partial(fn, w)
             for w in weights]  # fmt: skip
    return graph_time_ms(calls, reps=4, replays=5) * 1000


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--out", default="fp8_small_batch.json")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    results = []
    for name in args.shapes:
        n, k, ops = SHAPES[name]
        copies = max(2, -(-3 * L2_BYTES // (n * k)))
        bf16 = [0.02 * torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        fp8 = []
        for w in bf16:
            w8, s = reference.quantize_fp8(w, None)
            fp8.append((w8, s.view(-1).contiguous()))
        nw = 1 + 0.1 * torch.randn(k, device=dev, dtype=torch.bfloat16)
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            res = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
            f_bf16 = functools.partial(fused, ops, x, res, nw)
            f_fp8 = functools.partial(fused, ops, x, res, nw)
            f_gemm = functools.partial(gemm_path, ops, x, res, nw)
            want = f_gemm(*fp8[0])
            row = {
                "shape": name, "n": n, "k": k, "rows": rows, "fused_ops": ops,
                "fp8_bytes_floor_us": n * k / COPY_BANDWIDTH * 1e6,
                "bf16_us": time_us(f_bf16, bf16),
                "fp8_us": time_us(f_fp8, fp8),
                "fp8_gemm_us": time_us(f_gemm, fp8),
                "fp8_max_abs_err_vs_gemm": (f_fp8(*fp8[0]) - want).abs().max().item(),
                "fp8_default_config": list(sbl._tile_config(n, k, x.device, 1, ops != "none")),
            }  # fmt: skip
            results.append(row)
            print(
                f"{name:8s} rows={rows}: floor {row['fp8_bytes_floor_us']:6.1f} us, bf16 "
                f"{row['bf16_us']:6.1f}, fp8 {row['fp8_us']:6.1f} {row['fp8_default_config']}, "
                f"fp8 gemm path {row['fp8_gemm_us']:6.1f}, "
                f"err {row['fp8_max_abs_err_vs_gemm']:.3g}",
                flush=True,
            )
            if rows != 1 or args.no_sweep:
                continue
            configs = itertools.product((32, 64), (128, 256, 512, 1024), (4,), (3, 4, 6))
            tiles = sweep(
                sbl,
                configs,
                functools.partial(f_fp8, *fp8[0]),
                lambda run, f=f_fp8, w=fp8: time_us(f, w) / 1000,
                want,
                f"{name} rows={rows}",
            )
            tiles.sort(key=lambda t: t["ms"])
            row["best_tiles"] = tiles[:6]
            print(f"  best tiles: {[(round(t['ms'] * 1000, 1), t['config']) for t in tiles[:4]]}")
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
