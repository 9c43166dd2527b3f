"""Float8 decode attention: the stream-K schedule against the packed kernel's grid, one layer.

    PYTHONPATH=benchmarks:. python3 benchmarks/decode_stream_k_sweep.py --out decode_stream_k.json

At 1000/1000's shapes the packed kernel runs a program per (sequence, KV head) in waves of 1056
(8 an SM on an H200), the last partly filled (~3% of decode attention at 1000 x 1.5k:
docs/performance.md, "The H200 on 2026-12-03, fifth run"). decode_attention_stream_k runs one
wave of equal shares instead. This times one layer (Llama-3.1-8B: 8 KV heads, head_dim 128,
block 16, sequential blocks) inside a CUDA graph at 256-1088 rows (every 64, and 960, 1000) and
contexts of 192, 1500 and 2000 keys, all of one length as in 1000/1000's waves, then at mixed
lengths (each row uniform in [context / 2, context]); each shape with the packed grid, stream-K
at the rule's grid (8 an SM) and at twice it, stream-K with the natural key loop (two tiles in
flight, 7 an SM), over the engine's token-major cache blocks, and the packed grid and both
stream-K loops again over the same caches laid out head-major (a
head's keys of a block contiguous: measured 2.5-4% faster a layer for the kernel before the
packed one, benchmarks/results/2026-12-02-h200-pdl-kv-layout/, never for the packed one). Each
output is checked against the packed kernel's (the same keys merged in another order: ~1e-3
relative at bf16 outputs; bit-equal across layouts), and one shape against the fp32 reference.
The stream-K kernels' registers, shared memory and the driver's programs an SM are recorded
(the rule's grid assumes 8, the natural loop's 7).

What to expect: benchmarks/decode_stream_k_expected.md.
"""

from __future__ import annotations

import argparse
import json

import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, errors, inputs
from decode_waves_sweep import _driver
from tile_sweep import graph_time_ms

from kiln.kernels import reference
from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton import decode_attention_stream_k as dsk

ROWS = sorted({*range(256, 1089, 64), 960, 1000})
CONTEXTS = (1500, 2000, 192)
MIXED_ROWS = (512, 768, 1000)
# (name, stream-K on, its grid in programs an SM (0: the rule's), cache blocks head-major,
# the natural key loop: two tiles in flight)
VARIANTS = (
    ("packed", False, 0, False, False),
    ("stream_k", True, 0, False, False),
    ("stream_k_x2", True, 16, False, False),
    ("stream_k_natural", True, 0, False, True),
    ("packed_head_major", False, 0, True, False),
    ("stream_k_head_major", True, 0, True, False),
    ("stream_k_natural_head_major", True, 0, True, True),
)


def _layer(layer_inputs: tuple, scale: float, context: int):
    q, k8, v8, table, lens = layer_inputs
    return lambda: da.paged_decode_attention_splits(q, k8, v8, table, lens, scale, context, 1)


def _head_major(layer_inputs: tuple) -> tuple:
    """The same caches (same values at the same indices) with blocks laid out head-major."""
    q, k8, v8, table, lens = layer_inputs
    return q, *(c.transpose(1, 2).contiguous().transpose(1, 2) for c in (k8, v8)), table, lens


def _time_variants(layer_inputs: tuple, scale: float, context: int, sms: int) -> dict:
    """Each variant's us and its output's difference from the packed kernel's."""
    runs = {False: _layer(layer_inputs, scale, context)}
    runs[True] = _layer(_head_major(layer_inputs), scale, context)
    kv_bytes = 2 * int(layer_inputs[4].sum()) * KV_HEADS * HEAD_DIM  # float8 K and V read
    found: dict = {}
    packed = None
    for name, stream_k, per_sm, head_major, natural in VARIANTS:
        da.STREAM_K, da.STREAM_K_PROGRAMS, da.STREAM_K_NATURAL = stream_k, per_sm * sms, natural
        run = runs[head_major]
        out = run().float()
        packed = out if packed is None else packed
        us = graph_time_ms([run], 10, 3) * 1e3
        found[name] = {
            "us": us,
            "TBps": kv_bytes / us / 1e6,
            "rel_diff_vs_packed": float((out - packed).norm() / packed.norm()),
        }
    da.STREAM_K, da.STREAM_K_PROGRAMS, da.STREAM_K_NATURAL = False, 0, False
    return found


def _compiled() -> list:
    return [
        c for cache in dsk._decode_stream_k_kernel.device_caches.values() for c in cache[0].values()
    ]


def _record(record: dict, table: str, label: str, entry: dict, out_path: str) -> None:
    """Prints a shape's times and rewrites the JSON (a run cut short keeps what it measured)."""
    record[table].append(entry)
    print(f"{label}: " + ", ".join(f"{n} {entry[n]['us']:.1f}" for n, *_ in VARIANTS), flush=True)
    with open(out_path, "w") as f:
        json.dump(record, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_stream_k.json")
    args = parser.parse_args()
    PLACEMENT["mode"] = "sequential"
    scale = HEAD_DIM**-0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    record: dict = {"gpu": torch.cuda.get_device_name(), "sms": sms, "shapes": [], "mixed": []}

    # The fp32 reference at one 1000/1000 shape (stream-K on, the rule's grid).
    q, k8, v8, table, lens = inputs(1000, 1500)
    da.STREAM_K = True
    out = _layer((q, k8, v8, table, lens), scale, 1500)()
    da.STREAM_K = False
    # The fp32 reference pads every row to 1500 keys in fp32: the first 200 rows keep it within
    # an 80 GB card (all 1000 asked for 23 GB beyond what an H100 had left).
    ref = reference.paged_decode_attention(
        q[:200].float(), k8.float(), v8.float(), table[:200], lens[:200], scale, 1500
    )
    record["stream_k_vs_reference_1000x1500"] = errors(out[:200], ref)
    print(
        "stream-K against the reference at 1000 x 1500:", record["stream_k_vs_reference_1000x1500"]
    )
    del q, k8, v8, table, lens, out, ref

    for context in CONTEXTS:
        for rows in ROWS:
            entry = {
                "rows": rows,
                "context": context,
                **_time_variants(inputs(rows, context), scale, context, sms),
            }
            _record(record, "shapes", f"{rows}x{context}", entry, args.out)

    for context in (1500, 2000):
        for rows in MIXED_ROWS:
            layer_inputs = inputs(rows, context)
            gen = torch.Generator(device="cuda").manual_seed(rows + context)
            layer_inputs[4].copy_(
                torch.randint(context // 2, context + 1, (rows,), device="cuda", generator=gen)
            )
            entry = {
                "rows": rows,
                "context": f"{context // 2}-{context}",
                **_time_variants(layer_inputs, scale, context, sms),
            }
            _record(record, "mixed", f"{rows}x[{context // 2}, {context}]", entry, args.out)

    # Every stream-K kernel compiled above (both key loops): registers, shared memory and the
    # driver's programs an SM, against the grid's assumption (8; the natural loop 7).
    record["stream_k_kernels"] = [_driver(c) for c in _compiled()]
    print("stream-K kernels:", record["stream_k_kernels"], flush=True)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
