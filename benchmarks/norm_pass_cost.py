"""What the norm-fused one-row projections pay for their pass over the input row (batch 1).

    PYTHONPATH=benchmarks:. python3 benchmarks/norm_pass_cost.py --out norm_pass.json
    PYTHONPATH=benchmarks:. python3 benchmarks/norm_pass_cost.py --dry-run   # the CPU

qkv and gate_up run the residual add and RMSNorm inside their one-row kernel: every program
first reads the whole input row (x, the residual and the norm weight, 24 KiB at Llama-3.1-8B) for
RMSNorm's sum of squares, in 2-4 dependent steps, and only then starts its weight stream; the
stream's loop then normalises each chunk before quantizing it, and each program writes a slice of
x + residual. The same kernel with no norm (PROLOGUE plain: the row given already normed, the
static scale) on the same weight and tiles has none of that. Their difference bounds what a design
that computes the sum of squares once, in the producing kernel's epilogue, could save a layer.

Each side timed as back-to-back calls in one CUDA graph with the weight's copies cycled (more
bytes than L2 holds). qkv's own kernel (rotary, KV write) is stood in for by the norm-fused
projection at qkv's tiles.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from one_row_fixed_cost import L2_BYTES, _time_us, _weights  # benchmarks/, this script's folder

from kiln.kernels.triton import small_batch_linear as sbl
from kiln.kernels.triton import small_batch_tiles
from kiln.kernels.triton.small_batch_tiles import Tiles

# name: (the norm kernel's table name, weight rows, K, gated)
SHAPES = {
    "qkv": ("qkv_rotary", 6144, 4096, False),
    "gate_up": ("norm_linear_silu_mul", 28672, 4096, True),
}


def _rows(name: str, dev: str) -> list[dict]:
    kernel, n_rows, k, gated = SHAPES[name]
    if dev == "cpu":
        n_rows, k = n_rows // 64, k // 64
        tiles = Tiles(16, 32, 4, 1)
    else:
        tiles = small_batch_tiles.tile_config(kernel, n_rows, k, torch.device(dev), 1)
    copies = max(2, 2 * L2_BYTES // (n_rows * k) + 1) if dev == "cuda" else 2
    weights = _weights(n_rows, k, copies, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    norm_weight = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
    scale = torch.tensor(0.02, device=dev)
    summed = torch.empty_like(x)
    sides = {
        "norm_fused": dict(
            prologue=sbl._ADD_NORM,
            kwargs=dict(residual=residual, norm_weight=norm_weight, eps=1e-5, summed=summed),
        ),
        "norm_no_residual": dict(
            prologue=sbl._NORM, kwargs=dict(norm_weight=norm_weight, eps=1e-5)
        ),
        "norm_fused_one_pass_step": dict(
            prologue=sbl._ADD_NORM,
            kwargs=dict(residual=residual, norm_weight=norm_weight, eps=1e-5, summed=summed),
            tiles=tiles._replace(stats_block=k),
        ),
        "plain": dict(prologue=sbl._PLAIN, kwargs={}),
    }
    original = small_batch_tiles.tile_config
    rows = []
    try:
        for side, spec in sides.items():
            side_tiles = spec.get("tiles", tiles)
            small_batch_tiles.tile_config = lambda *a, t=side_tiles, **kw: t

            def call(w, ws, spec=spec):
                return sbl._launch(
                    spec["prologue"], x, w, None, weight_scale=ws, input_scale=scale,
                    gated=gated, **spec["kwargs"],
                )  # fmt: skip

            call(*weights[0])
            calls = [functools.partial(call, w, ws) for w, ws in weights]
            rows.append({"shape": name, "side": side, "tiles": list(side_tiles),
                         "us": _time_us(calls, 2, dev)})  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    finally:
        small_batch_tiles.tile_config = original
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = p.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    rows = [row for name in SHAPES for row in _rows(name, dev)]
    if args.out:
        device = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
        with open(args.out, "w") as f:
            json.dump({"device": device, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
