"""What outlier columns (`kiln build --outlier-columns 16`) cost on the GPU, block by block.

    PYTHONPATH=benchmarks:. python3 benchmarks/outlier_columns_cost.py --out outlier_cost.json
    PYTHONPATH=benchmarks:. python3 benchmarks/outlier_columns_cost.py --dry-run   # the CPU

A projection with outlier columns runs its quantizing op (the norm, the SiLU-mul or the quantize
kernel, writing the remainders after its own columns), then `_scaled_mm` over K + 16; it loses
the small-batch kernels. (Until 2026-12-05's third call the remainders were torch ops: gather,
subtraction, concatenation.) This times, at Llama-3.1-8B's shapes (hidden 4096, 32 query / 8 KV
heads of 128, intermediate 14336), static fp8, the decoder's own entry points with the engine's
Fp8LinearMethod and with OutlierColumnsFp8LinearMethod side by side, each inside a CUDA graph:
the attention block's norm + qkv, o_proj, and the MLP block (norm + gate_up + SiLU-mul + down),
at 1, 16, 256, 1000 and 8192 rows. Dummy weights (normal, std 0.02) and a static scale of 4/448;
`--channels` sets the columns (16).

Measured: benchmarks/results/2026-12-05-h200-decode-occupancy-outlier-cost/ (unfused 1.4-4.4x a
block; the remainders fused, 1.05-1.26x, the rest the GEMM's row stride; then rows 128 bytes
apart).
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln.kernels import reference
from kiln.layers.linear import Linear
from kiln.quantization.fp8 import Fp8LinearMethod
from kiln.quantization.outlier_columns import OutlierColumnsFp8LinearMethod

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 14336
ROWS = (1, 16, 256, 1000, 8192)
CHANNELS = 16
SCALE = 4.0 / 448.0
EPS = 1e-5


def _projection(k: int, n: int, outlier: int, dtype: torch.dtype, sizes=None) -> Linear:
    gen = torch.Generator().manual_seed(k * 7 + n)
    if outlier:  # that many channels, spread over the input as the loudest ones are
        channels = list(range(0, k, k // outlier))[:outlier]
        method = OutlierColumnsFp8LinearMethod("static", SCALE, channels=channels)
    else:
        method = Fp8LinearMethod("static", SCALE)
    layer = Linear(k, n, method=method, dtype=dtype, output_sizes=sizes)
    weight = (torch.randn(n, k, generator=gen, device="cpu") * 0.02).to(layer.weight_scale.device)
    layer.weight_loader(layer.weight, None, weight)
    method.process_weights_after_loading(layer)  # as the model loader does
    return layer


def _blocks(ops, outlier: int, rows: int, dtype: torch.dtype, scale: int) -> dict:
    """name -> a no-argument call of one decoder block's projections as the model runs them."""
    hidden, inter = HIDDEN // scale, INTERMEDIATE // scale
    heads, kv_heads = HEADS // scale, KV_HEADS // scale
    q, kv = heads * HEAD_DIM, kv_heads * HEAD_DIM
    qkv = _projection(hidden, q + 2 * kv, outlier, dtype, [q, kv, kv])
    o_proj = _projection(q, hidden, outlier, dtype)
    gate_up = _projection(hidden, 2 * inter, outlier, dtype, [inter, inter])
    down = _projection(inter, hidden, outlier, dtype)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen, device="cpu").to(qkv.weight_scale.device, dtype)
    residual = torch.randn(rows, hidden, generator=gen, device="cpu").to(x.device, dtype)
    attn_out = torch.randn(rows, q, generator=gen, device="cpu").to(x.device, dtype)
    norm = torch.ones(hidden, dtype=dtype, device=x.device)
    return {
        "norm + qkv": lambda: qkv.method.add_rms_norm_apply(qkv, ops, x, residual, norm, EPS),
        "o_proj": lambda: o_proj(ops, attn_out),
        "mlp (norm + gate_up + silu-mul + down)": lambda: gate_up.silu_mul_into(
            ops, down, x, residual, norm, EPS
        ),
    }


def _first(out: object) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="outlier_columns_cost.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, the reference ops")
    parser.add_argument("--channels", type=int, default=CHANNELS, help="outlier columns")
    args = parser.parse_args()
    if args.dry_run:
        scale, rows_list, dtype = 8, (1, 5), torch.float32
        ops, device, timed = reference, "cpu", False
    else:
        from tile_sweep import graph_time_ms

        from kiln.kernels import triton as ops

        scale, rows_list, dtype, device, timed = 1, ROWS, torch.bfloat16, "cuda", True
    results = []
    with torch.device(device):
        for rows in rows_list:
            plain = _blocks(ops, 0, rows, dtype, scale)
            outlier = _blocks(ops, args.channels, rows, dtype, scale)
            for name in plain:
                row = {"rows": rows, "block": name}
                if timed:
                    row["plain_us"] = 1000 * graph_time_ms([plain[name]], reps=20, replays=5)
                    row["outlier_us"] = 1000 * graph_time_ms([outlier[name]], reps=20, replays=5)
                    row["ratio"] = row["outlier_us"] / row["plain_us"]
                else:  # the dry run: both run and agree within float8's rounding
                    a, b = _first(plain[name]()), _first(outlier[name]())
                    assert a.shape == b.shape, (name, a.shape, b.shape)
                    assert (a - b).float().norm() < 0.1 * a.float().norm(), name
                results.append(row)
                print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        shape = "llama-3.1-8b" if timed else f"1/{scale}"
        json.dump({"shape": shape, "channels": args.channels, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
