"""Decode attention over a float8 cache: the packed kernel against today's, one layer, H200.

    PYTHONPATH=. python3 benchmarks/decode_packed_sweep.py --out decode_packed.json
    PYTHONPATH=. python3 benchmarks/decode_packed_sweep.py --smoke   # CPU, interpreter, tiny

Each of the packed kernel's key loops (--loops, default 1,2,3: decode_attention.PACKED_LOOP; 1 is
the first version, 2 the default, benchmarks/results/2026-12-03-cpu-decode-packed-sass/) at its
default tile and over every tile, the new loops also over NEW_TILES (8-key sub-tiles, register
caps). --smoke
runs the whole script on the CPU under the Triton interpreter at one tiny shape, two tiles, an
fp16 query (the interpreter cannot run the bf16 query's inline-PTX widening) and wall-clock
"times" (meaningless as times: a check that the script and every loop run end to end).

kiln/kernels/triton/decode_attention_packed.py puts PACK = 16 / GROUP sub-partitions of a
program's keys side by side in the 16 rows that tl.dot pads the GQA group to (4 heads for
Llama-3.1-8B), instead of 12 rows of zeros. Compiled for sm_90 on the CPU (Triton 3.6): one warp of
16-key sub-tiles holds 196 registers (today's one-warp kernel 255) and its loop issues 20.4
instructions a key (today 35.7); two warps 146 registers, 22.8 a key; four warps 126, 32.8 (today's
four-warp kernel 40.4). Measured here at Llama-3.1-8B shapes (8 KV heads, head_dim 128, block 16),
GPU time in a CUDA graph: today's kernel over bf16 and float8 caches, and the packed kernel over
tiles (keys per sub-tile, warps, stages), each output's error against the fp32 reference over the
same float8 values beside its time. Expectations: benchmarks/decode_packed_expected.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from functools import partial

if "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, errors, inputs_and_reference
from tile_sweep import forced_tile_config, graph_time_ms

from kiln.kernels.triton import decode_attention as da

# 1000/1000's and 2048/128's decode rows, 128/128's, a long context, a short one, batch 1.
SHAPES = [(768, 1500), (384, 1500), (512, 192), (64, 4096), (32, 1024), (1, 1024)]
PACKED_TILES = list(itertools.product((16, 32), (1, 2, 4), (1, 2, 3)))
# Tiles only the new loops run (LOOP 1's per-sub-tile P @ V needs BLOCK_N >= 16), some with a
# register cap (a fourth element, maxnreg). One warp a program was best on 2026-12-02 where the
# grid fills the SMs many times over, and occupancy mattered (today's (16, 1, 2): 9 programs an
# SM, 630 us at 768 x 1.5k; (32, 1, 2), 5 an SM: 949). Compiled for sm_90 (benchmarks/results/
# 2026-12-03-cpu-decode-packed-sass/): LOOP 2 at (16, 1, 2) holds 36 KB of shared memory (6
# programs an SM); (16, 1, 1, 224) 20 KB and 218 registers (9, no prefetch); (8, 1, 2) 20 KB
# and 230 registers (8; 9 at 224, 10 at 200), 16.2 instructions a key (14.0 skipping the
# rescale) against (16, 1, 2)'s 13.5 (12.4).
NEW_TILES = [
    (16, 1, 1, 224), (16, 1, 2, 224), (16, 1, 1, 200),
    (8, 1, 2), (8, 1, 2, 224), (8, 1, 2, 200), (8, 1, 3), (8, 2, 2), (32, 2, 1),
]  # fmt: skip


def time_ms(calls: list) -> float:
    """GPU time a call in a CUDA graph; without CUDA (--smoke) one call's wall clock."""
    if torch.cuda.is_available():
        return graph_time_ms(calls, 20, 3)
    t0 = time.perf_counter()
    for fn in calls:
        fn()
    return (time.perf_counter() - t0) * 1e3 / len(calls)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_packed.json")
    parser.add_argument("--placement", choices=("random", "sequential"), default="sequential")
    parser.add_argument(
        "--loops", default="1,2,3", help="the packed kernel's key loops (PACKED_LOOP) to time"
    )
    parser.add_argument(
        "--shapes", help="batch x context pairs, e.g. 768x1500,8x300 (default: SHAPES)"
    )
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, one tiny shape")
    args = parser.parse_args()
    loops = [int(x) for x in args.loops.split(",")]
    shapes, tiles, new_tiles = SHAPES, PACKED_TILES, NEW_TILES
    if args.smoke:
        shapes, tiles, new_tiles = [(2, 100)], [(16, 1, 2)], [(16, 1, 1, 224), (8, 1, 2)]
    if args.shapes:
        shapes = [tuple(int(v) for v in pair.split("x")) for pair in args.shapes.split(",")]
    PLACEMENT["mode"] = args.placement
    record: dict = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "placement": args.placement, "loops": loops, "shapes": [],
    }  # fmt: skip
    scale = HEAD_DIM**-0.5
    for batch, context in shapes:
        q, k8, v8, table, lens, kb, vb, ref = inputs_and_reference(batch, context, scale)
        if args.smoke:
            q = q.half()
        fp8_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM

        def run(kc, vc, q=q, table=table, lens=lens, context=context):
            return da.paged_decode_attention(q, kc, vc, table, lens, scale, context)

        row: dict = {"batch": batch, "context": context, "splits": da.choose_num_splits(
            batch, KV_HEADS, context, da.num_sms(q.device)
        ), "packed": []}  # fmt: skip
        da.PACKED = False
        row["bf16_us"] = time_ms([partial(run, kb, vb)]) * 1e3
        row["fp8_us"] = time_ms([partial(run, k8, v8)]) * 1e3
        row["fp8_err"] = errors(run(k8, v8), ref)
        row["fp8_TBps"] = fp8_bytes / row["fp8_us"] / 1e6
        da.PACKED = True
        default_loop = da.PACKED_LOOP
        try:
            # The default tile at each loop: "packed_default_us" at the loop the engine runs.
            for loop in loops:
                da.PACKED_LOOP = loop
                row[f"packed_default_loop{loop}_us"] = time_ms([partial(run, k8, v8)]) * 1e3
            da.PACKED_LOOP = default_loop
            row["packed_default_loop"] = default_loop
            row["packed_default_us"] = time_ms([partial(run, k8, v8)]) * 1e3
            row["packed_default_err"] = errors(run(k8, v8), ref)
            for loop in loops:
                da.PACKED_LOOP = loop
                for tile in tiles + (new_tiles if loop != 1 else []):
                    entry: dict = {"loop": loop, "tile": list(tile)}
                    try:
                        with forced_tile_config(da, tile, "_packed_tile_config"):
                            entry["err"] = errors(run(k8, v8), ref)
                            entry["us"] = time_ms([partial(run, k8, v8)]) * 1e3
                        entry["TBps"] = fp8_bytes / entry["us"] / 1e6
                    except Exception as exc:
                        entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                    row["packed"].append(entry)
        finally:
            da.PACKED = False
            da.PACKED_LOOP = default_loop
        timed = [e for e in row["packed"] if "us" in e]
        if timed:
            row["best"] = min(timed, key=lambda e: e["us"])
            for loop in loops:
                mine = [e for e in timed if e["loop"] == loop]
                if mine:
                    row[f"best_loop{loop}"] = min(mine, key=lambda e: e["us"])
        print(f"{batch}x{context}: bf16 {row['bf16_us']:.1f} us, float8 {row['fp8_us']:.1f} "
              f"({row['fp8_TBps']:.2f} TB/s), packed default {row['packed_default_us']:.1f}, "
              f"best {row.get('best')}", flush=True)  # fmt: skip
        for loop in loops:
            print(f"  loop {loop}: default tile {row[f'packed_default_loop{loop}_us']:.1f} us, "
                  f"best {row.get(f'best_loop{loop}')}", flush=True)  # fmt: skip
        record["shapes"].append(row)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
