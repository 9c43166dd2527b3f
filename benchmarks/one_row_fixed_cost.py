"""Where a one-row float8 projection's time goes (batch-1 decode), beyond its weight's bytes.

    PYTHONPATH=benchmarks:. python3 benchmarks/one_row_fixed_cost.py --out one_row.json
    PYTHONPATH=benchmarks:. python3 benchmarks/one_row_fixed_cost.py --dry-run   # the CPU

At batch 1 the engine's small-batch kernel runs o_proj (4096 x 4096 float8) in 9.1 us and down
(4096 x 14336) in 20.6 (small_batch_tiles.MEASURED_TILES): a line through the two gives ~3.6
TB/s and ~4.5 us a launch that no byte explains. Four of those a layer are ~0.6 ms of a 2.8 ms
step, the gap to the 420 tok/s target (docs/performance.md). This splits those 4.5 us, each
variant timed as back-to-back calls inside one CUDA graph (as the decode step runs them):

- `engine`: small_batch_linear.fp8_linear, static scale, the measured tiles (split-K 4);
- `no_handoff`: the same kernel with split_k.arrive answering "not last" to every program: each
  stores its partial sums and exits; no fence, ticket or sum of the partials (what a design that
  reduces the splits elsewhere would pay);
- `split1`: no split (block_n 16: the same 256 programs, each over all of K), so no hand-off;
- `empty`: a kernel that only stores one int, the engine's grid and warps (the launch floor);
- each from HBM (weight copies cycled, more bytes than L2 holds) and from L2 (one copy).

engine - no_handoff is the hand-off; no_handoff(L2) - empty the pipeline's fill and drain; the
HBM - L2 difference what the bytes cost on top.

Measured (benchmarks/results/2026-12-05-h200-outlier-e2e-one-row-cost/): the hand-off ~1 us a
call, the launch floor 1.2, and o_proj from L2 without a hand-off still 6.65 us: the programs'
own chain over their K-steps, not the bytes or the hand-off.
"""

from __future__ import annotations

import argparse
import functools
import json
import types

import torch
import triton
import triton.language as tl
from tile_sweep import graph_time_ms  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels.triton import small_batch_linear as sbl
from kiln.kernels.triton import small_batch_tiles, split_k
from kiln.kernels.triton.small_batch_tiles import Tiles

SHAPES = {"o_proj": (4096, 4096), "down": (4096, 14336)}  # (N, K), Llama-3.1-8B
L2_BYTES = 50 * 2**20
SCALE = 4.0 / 448.0


@triton.jit
def _never_last(counter_ptr, tile, like, SPLIT_K: tl.constexpr):
    """split_k.arrive's stand-in: no ticket, no program is the last (its partials stay)."""
    return like < 0


@triton.jit
def _empty_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), 1)


def _no_handoff_kernel() -> triton.JITFunction:
    """_small_batch_linear_kernel compiled against a split_k whose arrive is _never_last."""
    fake_split_k = types.ModuleType("split_k_no_handoff")
    fake_split_k.__dict__.update(split_k.__dict__)
    fake_split_k.arrive = _never_last
    original = sbl._small_batch_linear_kernel.fn
    scope = dict(original.__globals__, split_k=fake_split_k)
    fn = types.FunctionType(original.__code__, scope, original.__name__, original.__defaults__)
    fn.__module__, fn.__qualname__ = original.__module__, original.__qualname__ + "_no_handoff"
    fn.__annotations__ = original.__annotations__  # which parameters are tl.constexpr
    return triton.jit(fn)


class _Variant:
    """Runs sbl.fp8_linear with a kernel and tiles swapped in for the call."""

    def __init__(self, kernel=None, tiles: Tiles | None = None) -> None:
        self.kernel, self.tiles = kernel, tiles

    def __call__(self, x, w, ws, scale) -> torch.Tensor:
        kernel, tile_config = sbl._small_batch_linear_kernel, small_batch_tiles.tile_config
        if self.kernel is not None:
            sbl._small_batch_linear_kernel = self.kernel
        if self.tiles is not None:
            small_batch_tiles.tile_config = lambda *a, **k: self.tiles
        try:
            return sbl.fp8_linear(x, w, ws, scale)
        finally:
            sbl._small_batch_linear_kernel, small_batch_tiles.tile_config = kernel, tile_config


def _weights(n: int, k: int, copies: int, dev: str):
    gen = torch.Generator(device=dev).manual_seed(n + k)
    out = []
    for _ in range(copies):
        w = torch.randn(n, k, generator=gen, device=dev) * 0.02
        w_fp8, ws = reference.quantize_fp8(w, None)  # a scale a row: per output channel
        out.append((w_fp8, ws.view(-1).contiguous()))
    return out


def _time_us(calls: list, reps: int, dev: str) -> float:
    return graph_time_ms(calls, reps=reps, replays=5) * 1000 if dev == "cuda" else float("nan")


def _shape_rows(name: str, n: int, k: int, dev: str, no_handoff) -> list[dict]:
    tiles = small_batch_tiles.tile_config("linear", n, k, torch.device(dev), 1, rows=1)
    if dev == "cpu":  # the interpreter's tiles, split so the hand-off runs
        tiles = tiles._replace(split_k=2)
    copies = max(2, 2 * L2_BYTES // (n * k) + 1) if dev == "cuda" else 2
    weights = _weights(n, k, copies, dev)
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
    scale = torch.tensor(SCALE, device=dev)
    want = reference.fp8_linear(x, *weights[0], scale)
    variants = {
        "engine": _Variant(tiles=tiles),
        "no_handoff": _Variant(kernel=no_handoff, tiles=tiles),
        "split1": _Variant(tiles=tiles._replace(block_n=16, split_k=1)),
    }
    rows = []
    for label, run in variants.items():
        got = run(x, *weights[0], scale)
        # no_handoff stores no output (its partials only): nothing to check
        err = None if label == "no_handoff" else (got.float() - want.float()).abs().max().item()
        for where, pool in (("hbm", weights), ("l2", weights[:1])):
            calls = [functools.partial(run, x, w, ws, scale) for w, ws in pool]
            us = _time_us(calls, 8 if where == "l2" else 2, dev)
            rows.append({"shape": name, "variant": label, "where": where, "us": us,
                         "tiles": list(run.tiles), "max_abs_err": err, "bytes": n * k})  # fmt: skip
    # The launch floor: the engine's grid and warps, one store a program.
    grid = (triton.cdiv(n, tiles.block_n), tiles.split_k)
    flag = torch.zeros(grid[0] * grid[1], dtype=torch.int32, device=dev)
    launch = functools.partial(_empty_kernel[grid], flag, num_warps=tiles.num_warps)
    launch()
    rows.append({"shape": name, "variant": "empty", "where": "-", "us": _time_us([launch], 64, dev),
                 "tiles": list(tiles)})  # fmt: skip
    if dev == "cuda":  # the copy floor: these bytes read and written
        src = weights[0][0].view(torch.uint8)
        dst = torch.empty_like(src)
        copy = functools.partial(dst.copy_, src)
        rows.append({"shape": name, "variant": "copy", "where": "hbm",
                     "us": _time_us([copy], 8, dev), "bytes": n * k})  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (interpreter)")
    args = p.parse_args()
    dev = "cpu" if args.dry_run else "cuda"
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "rows": []}
    no_handoff = _no_handoff_kernel()
    for name in args.shapes:
        n, k = SHAPES[name]
        if args.dry_run:
            n, k = n // 64, k // 64
        for row in _shape_rows(name, n, k, dev, no_handoff):
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
