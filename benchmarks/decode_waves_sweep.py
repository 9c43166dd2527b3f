"""Float8 decode attention at 1000/1000's row counts: does the grid's last partial wave cost?

    PYTHONPATH=benchmarks:. python3 benchmarks/decode_waves_sweep.py --out decode_waves.json

At 960 rows x 8 KV heads the packed kernel's grid is 7680 equal programs (every context the same
length in 1000/1000's waves), one sequence and KV head each, unsplit. If an SM keeps R of them,
the grid runs in ceil(7680 / (132 R)) waves and the last one partly full; a latency-bound kernel
takes about a whole wave's time for it. This times one layer (Llama-3.1-8B: 8 KV heads, head_dim
128, block 16, sequential blocks), inside a CUDA graph, at 640-1088 rows (every 64, and 960 and
1000) and three contexts, with 1, 2 and 3 splits (the reduce kernel included), and reads the
compiled kernel's registers to say how many programs an SM keeps. A staircase in us per row
against rows is the wave quantization; what split count flattens it is the lever. Outputs of 2
and 3 splits are checked against 1 split's (merging partitions only reorders the sums).

    PYTHONPATH=benchmarks:. python3 benchmarks/decode_waves_sweep.py --padding --out F.json

The first run (benchmarks/results/2026-12-03-h200-silu-static-grid/call2) found no wave
staircase and every split slower, but rows at odd multiples of 64 (704, 832, 960, 1088) 2-6%
slower a row than their multiple-of-128 neighbours at every context. --padding times rows every
32 unsplit, each beside the same rows in a grid padded with empty sequences to a multiple of 128:
if the padded grid is faster, the grid's shape (not the work) costs, and the kernel's grid can
be padded for nothing.
"""

from __future__ import annotations

import argparse
import json

import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, inputs
from tile_sweep import graph_time_ms

from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton import decode_attention_packed as dap

ROWS = sorted({*range(640, 1089, 64), 960, 1000})
CONTEXTS = (1000, 1500, 2000)
SPLITS = (1, 2, 3)
# --padding: rows every 32, unsplit, each also in a grid padded to a multiple of PAD_ROWS rows
# by empty sequences (length 0: a program loads its query, finds no key, writes zeros).
PAD_ROWS = 128


def _occupancy() -> dict:
    """Registers, shared memory and warps of the packed kernel's compiled variants (Triton's
    per-device cache), and the programs an SM keeps by registers (65536 a SM)."""
    found = []
    try:
        for cache in dap._decode_packed_kernel.device_caches.values():
            for compiled in cache[0].values():
                regs, warps = compiled.n_regs, compiled.metadata.num_warps
                found.append({
                    "registers": regs, "warps": warps, "shared": compiled.metadata.shared,
                    "programs_an_sm_by_registers": 65536 // max(regs * 32 * warps, 1),
                })  # fmt: skip
    except Exception as exc:  # the compiled kernel's API differs across Triton versions
        found.append({"error": f"{type(exc).__name__}: {exc}"[:200]})
    return {"variants": found}


def _padded(entry: dict, rows: int, context: int, scale: float, padding: bool) -> str:
    """With --padding and rows not a multiple of PAD_ROWS: the same rows' time in a grid padded
    with empty sequences (entry["padded"]); the printed note."""
    padded_rows = -(-rows // PAD_ROWS) * PAD_ROWS
    if not padding or padded_rows == rows:
        return ""
    q, k8, v8, table, lens = inputs(padded_rows, context)
    lens[rows:] = 0

    def run():
        return da.paged_decode_attention_splits(q, k8, v8, table, lens, scale, context, 1)

    us = graph_time_ms([run], 10, 3) * 1e3
    entry["padded"] = {"grid_rows": padded_rows, "us": us, "us_a_row": us / rows}
    return f", padded to {padded_rows}: {us:.1f} us"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_waves.json")
    parser.add_argument("--padding", action="store_true", help="rows every 32, padded grids")
    args = parser.parse_args()
    rows_list = sorted({*range(640, 1089, 32), 1000}) if args.padding else ROWS
    splits_list = (1,) if args.padding else SPLITS
    PLACEMENT["mode"] = "sequential"
    scale = HEAD_DIM**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    record: dict = {"gpu": torch.cuda.get_device_name(), "sms": sms, "shapes": []}
    for context in CONTEXTS:
        for rows in rows_list:
            q, k8, v8, table, lens = inputs(rows, context)
            fp8_bytes = 2 * rows * context * KV_HEADS * HEAD_DIM
            entry: dict = {
                "rows": rows, "context": context,
                "rule_splits": da.choose_num_splits(rows, KV_HEADS, context, sms),
            }  # fmt: skip
            unsplit = None
            for splits in splits_list:

                def run(splits=splits, q=q, k8=k8, v8=v8, table=table, lens=lens, c=context):
                    return da.paged_decode_attention_splits(
                        q, k8, v8, table, lens, scale, c, splits
                    )

                out = run().float()
                if unsplit is None:
                    unsplit = out
                us = graph_time_ms([run], 10, 3) * 1e3
                entry[f"splits{splits}"] = {
                    "us": us, "us_a_row": us / rows, "TBps": fp8_bytes / us / 1e6,
                    "rel_diff_vs_unsplit": float((out - unsplit).norm() / unsplit.norm()),
                }  # fmt: skip
            print(
                f"{rows}x{context}: "
                + ", ".join(
                    f"{s} split(s) {entry[f'splits{s}']['us']:.1f} us "
                    f"({entry[f'splits{s}']['TBps']:.2f} TB/s)"
                    for s in splits_list
                )
                + _padded(entry, rows, context, scale, args.padding),
                flush=True,
            )
            record["shapes"].append(entry)
            del q, k8, v8, table, lens
        record["occupancy"] = _occupancy()
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record["occupancy"]), flush=True)


if __name__ == "__main__":
    main()
