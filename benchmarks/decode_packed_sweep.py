"""Decode attention over a float8 cache: the packed kernel against today's, one layer, H200.

    PYTHONPATH=. python3 benchmarks/decode_packed_sweep.py --out decode_packed.json

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
from functools import partial

import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, errors, inputs_and_reference
from tile_sweep import forced_tile_config, graph_time_ms

from kiln.kernels.triton import decode_attention as da

# 1000/1000's and 2048/128's decode rows, 128/128's, a long context, a short one, batch 1.
SHAPES = [(768, 1500), (384, 1500), (512, 192), (64, 4096), (32, 1024), (1, 1024)]
PACKED_TILES = list(itertools.product((16, 32), (1, 2, 4), (1, 2, 3)))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_packed.json")
    parser.add_argument("--placement", choices=("random", "sequential"), default="sequential")
    args = parser.parse_args()
    PLACEMENT["mode"] = args.placement
    record: dict = {"gpu": torch.cuda.get_device_name(), "placement": args.placement, "shapes": []}
    scale = HEAD_DIM**-0.5
    for batch, context in SHAPES:
        q, k8, v8, table, lens, kb, vb, ref = inputs_and_reference(batch, context, scale)
        fp8_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM

        def run(kc, vc, q=q, table=table, lens=lens, context=context):
            return da.paged_decode_attention(q, kc, vc, table, lens, scale, context)

        row: dict = {"batch": batch, "context": context, "splits": da.choose_num_splits(
            batch, KV_HEADS, context, torch.cuda.get_device_properties(0).multi_processor_count
        ), "packed": []}  # fmt: skip
        da.PACKED = False
        row["bf16_us"] = graph_time_ms([partial(run, kb, vb)], 20, 3) * 1e3
        row["fp8_us"] = graph_time_ms([partial(run, k8, v8)], 20, 3) * 1e3
        row["fp8_err"] = errors(run(k8, v8), ref)
        row["fp8_TBps"] = fp8_bytes / row["fp8_us"] / 1e6
        da.PACKED = True
        try:
            row["packed_default_us"] = graph_time_ms([partial(run, k8, v8)], 20, 3) * 1e3
            row["packed_default_err"] = errors(run(k8, v8), ref)
            for tile in PACKED_TILES:
                entry: dict = {"tile": list(tile)}
                try:
                    with forced_tile_config(da, tile, "_packed_tile_config"):
                        entry["err"] = errors(run(k8, v8), ref)
                        entry["us"] = graph_time_ms([partial(run, k8, v8)], 20, 3) * 1e3
                    entry["TBps"] = fp8_bytes / entry["us"] / 1e6
                except Exception as exc:
                    entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["packed"].append(entry)
        finally:
            da.PACKED = False
        timed = [e for e in row["packed"] if "us" in e]
        if timed:
            row["best"] = min(timed, key=lambda e: e["us"])
        print(f"{batch}x{context}: bf16 {row['bf16_us']:.1f} us, float8 {row['fp8_us']:.1f} "
              f"({row['fp8_TBps']:.2f} TB/s), packed default {row['packed_default_us']:.1f}, "
              f"best {row.get('best')}", flush=True)  # fmt: skip
        record["shapes"].append(row)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
