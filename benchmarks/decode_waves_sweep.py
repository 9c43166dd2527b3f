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

    PYTHONPATH=benchmarks:. python3 benchmarks/decode_waves_sweep.py --occupancy --out F.json

The second (call3 there): padding changes nothing; the time steps up past each multiple of 132
rows (1056 programs: 8 an SM). A one-warp program's 197 registers (200 allocated, 6400 a warp)
fit twice in an SM sub-partition's 16384, so an SM keeps 8; at 168 or fewer it keeps 3 a
sub-partition, and the 24 KiB of shared memory (+1 KiB reserved) each then allow 9 of the
228 KiB. --occupancy times the one-warp tile as the rule picks it, capped at 168 and 160
registers (Triton's maxnreg; compiled on the CPU: 3 and 2 spilled words a trip of 64 keys, 6%
more instructions a key), with the shared-memory carveout preference at its maximum, and one
stage (8 KiB) capped at 168 and 128 registers (12 and 16 an SM by registers), each beside the
programs an SM the driver reports for it (cuOccupancyMaxActiveBlocksPerMultiprocessor). For
1000 rows (8000 programs): 8 an SM are 7.58 waves, 9 are 6.73, 12 are 5.05, 16 are 3.79.
"""

from __future__ import annotations

import argparse
import json

import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, inputs
from tile_sweep import forced_tile_config, graph_time_ms

from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton import decode_attention_packed as dap

ROWS = sorted({*range(640, 1089, 64), 960, 1000})
CONTEXTS = (1000, 1500, 2000)
SPLITS = (1, 2, 3)
# --padding: rows every 32, unsplit, each also in a grid padded to a multiple of PAD_ROWS rows
# by empty sequences (length 0: a program loads its query, finds no key, writes zeros).
PAD_ROWS = 128


def _by_registers(registers: int, warps: int) -> int:
    """Programs an SM keeps by registers as CUDA's occupancy rule counts them
    (cuda_occupancy.h): a warp's registers (rounded up to 256) come from one of the SM's four
    sub-partitions of 16,384, so an SM holds 4 x (16384 // per warp) warps."""
    per_warp = -(-registers * 32 // 256) * 256
    return 4 * (16384 // per_warp) // warps


def _layer(inputs: tuple, scale: float, context: int, splits: int):
    """One layer's decode attention over `inputs` (q, k8, v8, table, lens), a callable."""
    q, k8, v8, table, lens = inputs
    return lambda: da.paged_decode_attention_splits(q, k8, v8, table, lens, scale, context, splits)


def _occupancy() -> dict:
    """Registers, shared memory and warps of the packed kernel's compiled variants (Triton's
    per-device cache), and the programs an SM keeps by registers."""
    try:
        found = [
            {
                "registers": c.n_regs, "warps": c.metadata.num_warps, "shared": c.metadata.shared,
                "programs_an_sm_by_registers": _by_registers(c.n_regs, c.metadata.num_warps),
            }
            for c in _compiled().values()
        ]  # fmt: skip
    except Exception as exc:  # the compiled kernel's API differs across Triton versions
        found = [{"error": f"{type(exc).__name__}: {exc}"[:200]}]
    return {"variants": found}


def _padded(entry: dict, rows: int, context: int, scale: float, padding: bool) -> str:
    """With --padding and rows not a multiple of PAD_ROWS: the same rows' time in a grid padded
    with empty sequences (entry["padded"]); the printed note."""
    padded_rows = -(-rows // PAD_ROWS) * PAD_ROWS
    if not padding or padded_rows == rows:
        return ""
    padded = inputs(padded_rows, context)
    padded[4][rows:] = 0  # the sequence lengths
    us = graph_time_ms([_layer(padded, scale, context, 1)], 10, 3) * 1e3
    entry["padded"] = {"grid_rows": padded_rows, "us": us, "us_a_row": us / rows}
    return f", padded to {padded_rows}: {us:.1f} us"


OCCUPANCY_ROWS = (768, 800, 896, 928, 960, 1000, 1024, 1056, 1088)
OCCUPANCY_CONTEXTS = (1500, 2000)
# (name, tile forced on _packed_tile_config, carveout at its maximum). (16, 1, 2) is the rule's
# one-warp tile above 12 programs an SM; one stage needs 8 KiB of shared memory, not 24, but 255
# registers, capped here at 168 (15 spilled words a trip of 64 keys) and 128.
OCCUPANCY_VARIANTS = (
    ("rule", (16, 1, 2), False),
    ("maxnreg168", (16, 1, 2, 168), False),
    ("maxnreg160", (16, 1, 2, 160), False),
    ("carveout100", (16, 1, 2), True),
    ("stages1_maxnreg168", (16, 1, 1, 168), False),
    ("stages1_maxnreg128", (16, 1, 1, 128), False),
)
_CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def _compiled() -> dict:
    """id -> the packed kernel's compiled variants (Triton's per-device cache)."""
    return {
        id(c): c for cache in dap._decode_packed_kernel.device_caches.values()
        for c in cache[0].values()
    }  # fmt: skip


def _set_carveout(compiled, percent: int) -> int:
    """The shared-memory carveout preference of a compiled kernel (-1: the driver's default;
    100: all of the unified L1 / shared memory as shared); cuFuncSetAttribute's result."""
    import ctypes

    compiled._init_handles()
    return ctypes.CDLL("libcuda.so.1").cuFuncSetAttribute(
        ctypes.c_void_p(compiled.function), ctypes.c_int(_CARVEOUT_ATTRIBUTE), ctypes.c_int(percent)
    )


def _driver(compiled) -> dict:
    """The driver's programs an SM for a compiled kernel (its warps, its dynamic shared memory)."""
    try:
        return _driver_query(compiled)
    except Exception as exc:  # the compiled kernel's API differs across Triton versions
        return {"error": f"{type(exc).__name__}: {exc}"[:200]}


def _driver_query(compiled) -> dict:
    import ctypes

    compiled._init_handles()
    blocks = ctypes.c_int()
    rc = ctypes.CDLL("libcuda.so.1").cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(blocks), ctypes.c_void_p(compiled.function),
        ctypes.c_int(32 * compiled.metadata.num_warps), ctypes.c_size_t(compiled.metadata.shared),
    )  # fmt: skip
    return {
        "registers": compiled.n_regs, "shared": compiled.metadata.shared, "occupancy_rc": rc,
        "programs_an_sm": blocks.value,
    }  # fmt: skip


def occupancy_sweep(out_path: str) -> None:
    scale = HEAD_DIM**-0.5
    record: dict = {"gpu": torch.cuda.get_device_name(), "variants": {}, "shapes": []}
    rule_kernels: list = []
    for context in OCCUPANCY_CONTEXTS:
        for rows in OCCUPANCY_ROWS:
            layer = _layer(inputs(rows, context), scale, context, 1)
            entry: dict = {"rows": rows, "context": context}
            reference = None
            for name, tile, carveout in OCCUPANCY_VARIANTS:
                with forced_tile_config(da, tile, "_packed_tile_config"):
                    before = _compiled()
                    out = layer().float()
                    new = [c for i, c in _compiled().items() if i not in before]
                    if name == "rule" and new:
                        rule_kernels = new
                    if carveout:  # on the rule's own kernel, for this variant only
                        entry["set_carveout_rc"] = [_set_carveout(c, 100) for c in rule_kernels]
                    if name not in record["variants"]:
                        record["variants"][name] = [_driver(c) for c in new or rule_kernels]
                    reference = out if reference is None else reference
                    us = graph_time_ms([layer], 10, 3) * 1e3
                    if carveout:
                        for c in rule_kernels:
                            _set_carveout(c, -1)
                entry[name] = {
                    "us": us, "us_a_row": us / rows,
                    "rel_diff": float((out - reference).norm() / reference.norm()),
                }  # fmt: skip
            times = ", ".join(f"{n} {entry[n]['us']:.1f}" for n, *_ in OCCUPANCY_VARIANTS)
            print(f"{rows}x{context}: {times}", flush=True)
            record["shapes"].append(entry)
            del layer
        with open(out_path, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record["variants"]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_waves.json")
    parser.add_argument("--padding", action="store_true", help="rows every 32, padded grids")
    parser.add_argument("--occupancy", action="store_true", help="register caps, carveout")
    args = parser.parse_args()
    PLACEMENT["mode"] = "sequential"
    if args.occupancy:
        occupancy_sweep(args.out)
        return
    rows_list = sorted({*range(640, 1089, 32), 1000}) if args.padding else ROWS
    splits_list = (1,) if args.padding else SPLITS
    PLACEMENT["mode"] = "sequential"
    scale = HEAD_DIM**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    record: dict = {"gpu": torch.cuda.get_device_name(), "sms": sms, "shapes": []}
    for context in CONTEXTS:
        for rows in rows_list:
            layer_inputs = inputs(rows, context)
            fp8_bytes = 2 * rows * context * KV_HEADS * HEAD_DIM
            entry: dict = {
                "rows": rows, "context": context,
                "rule_splits": da.choose_num_splits(rows, KV_HEADS, context, sms),
            }  # fmt: skip
            unsplit = None
            for splits in splits_list:
                run = _layer(layer_inputs, scale, context, splits)
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
            del layer_inputs, run
        record["occupancy"] = _occupancy()
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    print(json.dumps(record["occupancy"]), flush=True)


if __name__ == "__main__":
    main()
