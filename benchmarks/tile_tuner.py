"""The small-batch tile tuner: times the float8 small-batch kernels at Llama-3.1-8B's decode
shapes (GPU) under candidate launch shapes and prints the entries of
`kiln.kernels.triton.small_batch_tiles.MEASURED_TILES` that beat the engine's own launch.

    python3 benchmarks/tile_tuner.py --out tiles.json [--rows 1,8] [--shapes qkv,o_proj]
    python3 benchmarks/tile_tuner.py --out /tmp/tiles_tiny.json --tiny   # CPU smoke run

Per projection, the op a decode layer calls with static float8 scales (as `kiln build
--quantization fp8` engines run): qkv (norm, projection, rotary and KV write in one kernel),
o_proj, gate_up (norm, projection, SiLU-mul), down and the float8 LM head. The engine's launch
(the table's tiles, or the rule's where the table has no entry) is the baseline; each candidate is
forced by replacing `small_batch_tiles.tile_config` in this process only. Calls are timed back to
back inside one CUDA graph over enough weight copies that every call reads its weight from HBM.
Every output is compared with the kernels' twin (kiln.kernels.reference, fp32 products of the same
float8 values); a candidate further than --max-rel-err from it is reported and never suggested.
Paste the printed entries into MEASURED_TILES; `kiln build` records the tiles an engine runs with.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator

import torch

from kiln.kernels.kv_layout import empty_cache

HIDDEN, INTERMEDIATE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, VOCAB = 4096, 14336, 128, 32, 8, 128256
L2_BYTES = 50 * 2**20
SHAPES = {  # name: (the table's kernel at one row, weight rows, K)
    "qkv": ("qkv_rotary", (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN),
    "o_proj": ("linear", HIDDEN, HIDDEN),
    "gate_up": ("norm_linear_silu_mul", 2 * INTERMEDIATE, HIDDEN),
    "down": ("linear", HIDDEN, INTERMEDIATE),
    "lm_head": ("linear", VOCAB, HIDDEN),
}
# Launch shapes worth timing: (block_n, block_k, warps, stages, split_k, stats_block). Float8
# weights take the weight tile as the dot's first operand, a wgmma of at least 64 rows; gated and
# qkv programs split block_n between their two halves, so they need 128.
CANDIDATES = {
    "qkv": [(128, 256, 4, 3, 4, 2048), (128, 128, 4, 3, 8, 2048), (128, 256, 8, 3, 4, 2048),
            (128, 256, 4, 2, 4, 2048), (128, 256, 4, 3, 4, 1024), (256, 128, 8, 3, 4, 2048),
            (128, 256, 4, 4, 4, 2048)],
    "o_proj": [(128, 256, 4, 3, 4, 0), (64, 256, 4, 4, 4, 0), (128, 256, 8, 3, 4, 0),
               (128, 256, 4, 4, 4, 0), (128, 128, 4, 4, 4, 0), (128, 256, 4, 3, 2, 0),
               (256, 128, 8, 3, 4, 0), (128, 256, 4, 5, 4, 1024)],
    "gate_up": [(128, 256, 4, 3, 1, 1024), (128, 256, 4, 4, 1, 2048), (128, 256, 8, 3, 1, 1024),
                (128, 256, 4, 2, 1, 1024), (128, 512, 4, 2, 1, 1024), (256, 128, 8, 3, 1, 1024),
                (256, 256, 8, 3, 1, 1024), (128, 256, 4, 3, 1, 2048)],
    "down": [(64, 256, 4, 3, 4, 0), (128, 256, 4, 3, 4, 0), (128, 256, 8, 3, 4, 0),
             (128, 256, 8, 4, 4, 0), (128, 512, 8, 3, 4, 0), (256, 256, 8, 3, 4, 0),
             (128, 256, 4, 3, 2, 0), (128, 256, 4, 4, 4, 1024)],
    "lm_head": [(64, 512, 4, 3, 1, 0), (128, 512, 8, 3, 1, 0), (256, 256, 8, 3, 1, 0),
                (128, 256, 8, 4, 1, 0), (128, 256, 4, 5, 1, 0)],
}  # fmt: skip
# 2-8 rows: the plain kernel after the norm (qkv, gate_up and the LM head keep the rule there).
MULTI_ROW_SHAPES = ("o_proj", "down")


@contextlib.contextmanager
def forced_tiles(small_batch_tiles, tiles) -> Iterator[None]:
    """Every small-batch launch in this process takes `tiles` (None: the engine's own choice)."""
    if tiles is None:
        yield
        return
    chosen = small_batch_tiles.tile_config
    small_batch_tiles.tile_config = lambda *args, **kwargs: tiles
    try:
        yield
    finally:
        small_batch_tiles.tile_config = chosen


def graph_time_us(calls: list[Callable[[], object]], reps: int, replays: int = 5) -> float:
    """Microseconds per call of `calls` run back to back `reps` times over inside one CUDA graph
    (GPU time, no launch overhead); the best of `replays` timed replays."""
    for fn in calls:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for fn in calls:
                fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / (reps * len(calls)))
    return 1000 * best


class Projection:
    """One projection's operands (weight copies from HBM) and its decode-layer call."""

    def __init__(self, name: str, rows: int, dev: str) -> None:
        self.name = name
        _, n, k = SHAPES[name]
        g = torch.Generator(device=dev).manual_seed(0)
        dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # interpreter: fp16 dots
        copies = max(2, math.ceil(3 * L2_BYTES / (n * k))) if dev == "cuda" else 1
        self.weights = [
            (0.05 * torch.randn(n, k, device=dev, generator=g)).to(torch.float8_e4m3fn)
            for _ in range(copies)
        ]
        self.weight_scale = 0.01 + 0.01 * torch.rand(n, device=dev, generator=g)
        self.x = torch.randn(rows, k, device=dev, dtype=dtype, generator=g)
        self.residual = torch.randn(rows, k, device=dev, dtype=dtype, generator=g)
        self.norm_weight = (1 + 0.1 * torch.randn(k, device=dev, generator=g)).to(dtype)
        self.in_scale = torch.tensor(4.0 / 448, device=dev)  # |x| up to ~4 as static scales
        # Rotary inputs for qkv: Llama-3.1's rope base, positions from 1000, a small paged cache.
        half = torch.arange(HEAD_DIM // 2, dtype=torch.float32, device=dev)
        freqs = torch.arange(2048, dtype=torch.float32, device=dev)[:, None] / (
            500000 ** (2 * half / HEAD_DIM)
        )
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
        self.positions = torch.arange(1000, 1000 + rows, device=dev)
        self.slots = torch.arange(rows, device=dev) + 16
        cache_shape = (4, 16, NUM_KV_HEADS, HEAD_DIM)
        fp8 = torch.float8_e4m3fn
        self.caches = [empty_cache(*cache_shape, fp8, dev) for _ in "kv"]

    def call(self, ops, w: torch.Tensor) -> torch.Tensor:
        """The op as a decode layer calls it, from `ops` (the Triton kernels or their twin)."""
        x, res, nw = self.x, self.residual, self.norm_weight
        ws, s = self.weight_scale, self.in_scale
        if self.name == "qkv":
            return ops.add_rms_norm_qkv_rotary_write_kv(
                x, res, nw, 1e-5, w, None, self.positions, self.cos_sin, *self.caches,
                self.slots, ws, s,
            )[0]  # fmt: skip
        if self.name == "gate_up":
            return ops.add_rms_norm_linear_silu_mul(x, res, nw, 1e-5, w, ws, s)[0]
        return ops.fp8_linear(x, w, ws, s)


def measure(proj: Projection, ops, small_batch_tiles, tiles, truth, reps: int):
    """(us a call, relative error against the twin) with `tiles` forced (None: the engine's)."""
    with forced_tiles(small_batch_tiles, tiles):
        out = proj.call(ops, proj.weights[0])
        err = ((out.float() - truth.float()).abs().max() / truth.float().abs().max()).item()
        calls = [lambda w=w: proj.call(ops, w) for w in proj.weights]
        if proj.x.device.type != "cuda":  # the CPU smoke run: one call's wall time
            t0 = time.perf_counter()
            calls[0]()
            return 1e6 * (time.perf_counter() - t0), err
        return graph_time_us(calls, reps=max(1, reps // len(calls))), err


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="the JSON: every timing and the suggestions")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--reps", type=int, default=200)
    parser.add_argument("--max-rel-err", type=float, default=0.02)
    parser.add_argument("--min-gain", type=float, default=0.01, help="suggest only beyond noise")
    parser.add_argument(
        "--tiny", action="store_true", help="CPU smoke run: every size / 32, TRITON_INTERPRET=1"
    )
    args = parser.parse_args()
    global HEAD_DIM
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
        HEAD_DIM = 16
        for name, (kernel, n, k) in SHAPES.items():
            SHAPES[name] = (kernel, n // 32, k // 32)
        SHAPES["qkv"] = ("qkv_rotary", (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN // 32)
    elif not torch.cuda.is_available():
        sys.exit("no CUDA GPU: only --tiny runs here (under the Triton interpreter)")
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops
    from kiln.kernels.triton import small_batch_tiles

    dev = "cpu" if args.tiny else "cuda"
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)"
    result: dict = {"gpu": gpu, "command": " ".join(sys.argv), "rows": {}, "suggested": []}
    for rows in [int(r) for r in args.rows.split(",")]:
        for name in args.shapes.split(","):
            kernel, n, k = SHAPES[name]
            if rows > 1 and name not in MULTI_ROW_SHAPES:
                continue
            t0 = time.time()
            proj = Projection(name, rows, dev)
            truth = proj.call(reference, proj.weights[0])
            element_size = proj.weights[0].element_size()
            table_kernel = kernel if rows == 1 else "linear"
            table = small_batch_tiles.tile_config(
                table_kernel, n, k, proj.x.device, element_size, rows=rows
            )
            entry: dict = {"engine_tiles": list(table), "configs": []}
            candidates = [None] + [small_batch_tiles.Tiles(*c) for c in CANDIDATES[name]]
            for tiles in candidates:
                try:
                    us, err = measure(proj, triton_ops, small_batch_tiles, tiles, truth, args.reps)
                except Exception as exc:  # e.g. out of shared memory: reported, skipped
                    print(name, rows, tiles, "failed:", type(exc).__name__, exc)
                    continue
                config = {"tiles": list(tiles or table), "engine": tiles is None, "us": us,
                          "rel_err": err}  # fmt: skip
                entry["configs"].append(config)
                print(f"{name:8s} rows {rows} {config['tiles']} {us:8.2f} us err {err:.2e}"
                      f"{'  (the engine)' if tiles is None else ''}", flush=True)  # fmt: skip
            engine = next((c for c in entry["configs"] if c["engine"]), None)
            ok = [c for c in entry["configs"] if c["rel_err"] <= args.max_rel_err]
            if engine is not None and ok:
                best = min(ok, key=lambda c: c["us"])
                entry["best"] = best
                if not best["engine"] and best["us"] < (1 - args.min_gain) * engine["us"]:
                    key = [table_kernel, n, k, element_size, rows == 1]
                    result["suggested"].append([*key, best["tiles"], best["us"], engine["us"]])
            result["rows"].setdefault(str(rows), {})[name] = entry
            print(f"{name} rows {rows}: {time.time() - t0:.1f} s", flush=True)
            del proj
            if dev == "cuda":
                torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("small_batch_tiles.MEASURED_TILES entries (us a call, the engine's in brackets):")
    for kernel, n, k, size, one_row, tiles, us, before in result["suggested"]:
        fields = ", ".join(map(str, tiles))
        print(f"    ({kernel!r}, {n}, {k}, {size}, {one_row}): Tiles({fields}),"
              f"  # {us:.1f} us ({before:.1f})")  # fmt: skip
    if not result["suggested"]:
        print("    none: the table stands")


if __name__ == "__main__":
    main()
