"""Whether batch 1's float8 projections lose HBM bandwidth to their weight's row-major layout.

    PYTHONPATH=benchmarks:. python3 benchmarks/weight_layout_bench.py --out layout.json
    PYTHONPATH=benchmarks:. python3 benchmarks/weight_layout_bench.py --dry-run   # the CPU

A one-row projection's program reads, at each K-step, block_n rows' block_k bytes (256 of each
4096- or 14336-byte row), so the GPU's loads at any moment touch every row of the weight a little:
DRAM pages opened for 256 bytes. Nsight Compute had gate_up and down at 74% and 69% of DRAM's
bandwidth and qkv / o_proj at 44-46% (docs/performance.md, "Batch 1 on the H200 with the swapped
dot"). The same kernel reading a tile-contiguous copy of the weight (small_batch_linear.tile_weight:
each K-step's tile one contiguous run, a program's whole slice one run) isolates the layout's
share: the same programs, tiles, arithmetic and bits, only the addresses differ.

Each projection of Llama-3.1-8B at its engine tiles (small_batch_tiles), and a few other tiles a
contiguous layout might favour, timed as back-to-back calls in one CUDA graph with the weight's
copies cycled (more bytes than L2 holds, as a decode step streams them). Every result is compared
with the row-major launch's bits.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from tile_sweep import graph_time_ms  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels.triton import small_batch_linear as sbl
from kiln.kernels.triton import small_batch_tiles
from kiln.kernels.triton.small_batch_tiles import Tiles

L2_BYTES = 50 * 2**20
SCALE = 4.0 / 448.0
# name: (table kernel, weight rows, K, prologue, gated); qkv's own kernel (rotary, KV write)
# is stood in for by the norm-fused projection at its tiles.
SHAPES = {
    "qkv": ("norm_linear", 6144, 4096, sbl._ADD_NORM, False),
    "o_proj": ("linear", 4096, 4096, sbl._PLAIN, False),
    "gate_up": ("norm_linear_silu_mul", 28672, 4096, sbl._ADD_NORM, True),
    "down": ("linear", 4096, 14336, sbl._PLAIN, False),
}
QKV_TILES = small_batch_tiles.MEASURED_TILES[("qkv_rotary", 6144, 4096, 1, True)]


def _candidates(name: str, engine: Tiles) -> dict[str, Tiles]:
    out = {"engine": engine}
    if engine.block_k == 256:
        out["k512"] = engine._replace(block_k=512, block_n=max(engine.block_n // 2, 64))
    out["stages+1"] = engine._replace(num_stages=engine.num_stages + 1)
    if engine.split_k > 1:
        out["split2"] = engine._replace(split_k=2, num_stages=engine.num_stages + 1)
    return out


def _rows(name: str, dev: str) -> list[dict]:
    kernel, n_rows, k, prologue, gated = SHAPES[name]
    if dev == "cpu":
        n_rows, k = n_rows // 64, k // 64
    engine = (
        QKV_TILES
        if name == "qkv"
        else small_batch_tiles.tile_config(kernel, n_rows, k, torch.device(dev), 1)
    )
    if dev == "cpu":
        engine = Tiles(16, 32, 4, 1, split_k=engine.split_k)
    copies = max(2, 2 * L2_BYTES // (n_rows * k) + 1) if dev == "cuda" else 2
    gen = torch.Generator(device=dev).manual_seed(n_rows + k)
    weights = []
    for _ in range(copies):
        w, ws = reference.quantize_fp8(
            torch.randn(n_rows, k, generator=gen, device=dev) * 0.02, None
        )
        weights.append((w, ws.view(-1).contiguous()))
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    residual = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    norm_weight = torch.rand(k, device=dev, dtype=torch.bfloat16) + 0.5
    scale = torch.tensor(SCALE, device=dev)
    rows = []
    original = small_batch_tiles.tile_config
    for label, tiles in _candidates(name, engine).items():
        block_n = tiles.block_n // 2 if gated and dev == "cuda" else tiles.block_n
        half = n_rows // 2 if gated else n_rows
        if half % block_n or k % tiles.block_k:
            continue
        small_batch_tiles.tile_config = lambda *a, t=tiles, **kw: t
        try:
            kwargs = dict(gated=gated, input_scale=scale)
            if prologue != sbl._PLAIN:
                kwargs.update(
                    residual=residual, norm_weight=norm_weight, eps=1e-5, summed=torch.empty_like(x)
                )

            def call(w, ws, tiled, kwargs=kwargs):
                return sbl._launch(prologue, x, w, None, weight_scale=ws, tiled=tiled, **kwargs)

            tiled_weights = [
                (sbl.tile_weight(w, block_n, tiles.block_k, gated), ws) for w, ws in weights
            ]
            want = call(*weights[0], False)
            got = call(*tiled_weights[0], True)
            for layout, pool, tiled in (("rows", weights, False), ("tiled", tiled_weights, True)):
                calls = [functools.partial(call, w, ws, tiled) for w, ws in pool]
                us = (
                    graph_time_ms(calls, reps=2, replays=5) * 1000
                    if dev == "cuda"
                    else float("nan")
                )
                row = {
                    "shape": name, "tiles_label": label, "tiles": list(tiles), "layout": layout,
                    "us": us, "bytes": n_rows * k, "tb_s": n_rows * k / us / 1e6,
                    "equal_bits": bool(torch.equal(want, got)),
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            small_batch_tiles.tile_config = original
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = p.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    results = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "rows": []}
    for name in args.shapes:
        results["rows"] += _rows(name, dev)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
