"""Decode attention over a float8 cache: register caps and a float8 Q @ K^T with fp16 P @ V.

    PYTHONPATH=. python3 benchmarks/decode_fp8_occupancy_sweep.py --out decode_fp8_occupancy.json

Why (sm_90 SASS of the engine's kernel, compiled on the CPU): its one-warp tiles hold 255
registers a thread, so an SM keeps 8 of them; the four-warp tiles 123 registers and 41 issued
instructions a key against the bf16 kernel's 27, a quarter of them byte permutes that place
float8 K for Triton's own widening. Two ways out are measured here at Llama-3.1-8B shapes, one
layer, GPU time in a CUDA graph, beside today's kernel over bf16 and float8 caches:

- today's kernel with its registers capped (`maxnreg`): more programs an SM, paid in spills;
- benchmarks/decode_fp8_kernels.py's "swap" orientation (keys as the 64 rows of wgmma) with the
  query in float8 (S^T = K Q^T on float8 tensor cores: K goes from cp.async straight into the
  dot, no widening) and P @ V in fp16 (V widened by _fp8.py's cvt): ~25 instructions a key.

Each output's error against the fp32 reference over the same float8 values is recorded beside
its time. Expectations: benchmarks/decode_fp8_occupancy_expected.md.
"""

from __future__ import annotations

import argparse
import json
from functools import partial

import decode_fp8_kernels as dfp8  # benchmarks/, the script's folder
import torch
from decode_fp8_dots_sweep import HEAD_DIM, KV_HEADS, PLACEMENT, errors, inputs_and_reference
from tile_sweep import forced_tile_config, graph_time_ms

from kiln.kernels.triton import decode_attention as da

SHAPES = [(384, 1500), (512, 192), (64, 4096), (32, 1024)]
CAPPED = [(tile, cap) for tile in ((32, 1, 2), (64, 4, 2)) for cap in (None, 192, 168, 128)]
SWAP_TILES = [(64, 4, 2), (64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 8, 2), (64, 8, 2)]


class _RegisterCap:
    """Stands in for a @triton.jit kernel: every launch gets `maxnreg`."""

    def __init__(self, kernel, cap: int | None):
        self.kernel, self.cap = kernel, cap

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        extra = {} if self.cap is None else {"maxnreg": self.cap}
        return lambda *args, **kwargs: launch(*args, **kwargs, **extra)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_fp8_occupancy.json")
    parser.add_argument("--placement", choices=("random", "sequential"), default="sequential")
    parser.add_argument("--heads-first-only", action="store_true", help="only the grid order")
    args = parser.parse_args()
    PLACEMENT["mode"] = args.placement
    # "today" below is the neighbouring-sequences grid order, what every kernel ran when this
    # sweep was written; heads first is measured beside it.
    da.HEADS_FIRST_GRID = False
    record: dict = {"gpu": torch.cuda.get_device_name(), "placement": args.placement, "shapes": []}
    scale = HEAD_DIM**-0.5
    kernel = da._decode_kernel
    for batch, context in SHAPES:
        q, k8, v8, table, lens, kb, vb, ref = inputs_and_reference(batch, context, scale)
        fp8_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM

        def today(kc, vc, q=q, table=table, lens=lens, context=context):
            return da.paged_decode_attention(q, kc, vc, table, lens, scale, context)

        row: dict = {"batch": batch, "context": context, "capped": [], "swap": []}
        row["bf16_us"] = graph_time_ms([partial(today, kb, vb)], 20, 3) * 1e3
        row["fp8_us"] = graph_time_ms([partial(today, k8, v8)], 20, 3) * 1e3
        today_out = today(k8, v8)
        row["fp8_err"] = errors(today_out, ref)
        row["fp8_TBps"] = fp8_bytes / row["fp8_us"] / 1e6
        # The grid with a sequence's KV heads as neighbouring programs (da.HEADS_FIRST_GRID).
        da.HEADS_FIRST_GRID = True
        try:
            row["heads_first_bf16_us"] = graph_time_ms([partial(today, kb, vb)], 20, 3) * 1e3
            row["heads_first_fp8_us"] = graph_time_ms([partial(today, k8, v8)], 20, 3) * 1e3
            row["heads_first_fp8_equal"] = bool(torch.equal(today(k8, v8), today_out))
        finally:
            da.HEADS_FIRST_GRID = False
        hf_bf16, hf_fp8 = row["heads_first_bf16_us"], row["heads_first_fp8_us"]
        print(batch, context, "heads first: bf16", round(hf_bf16, 1), "fp8", round(hf_fp8, 1),
              row["heads_first_fp8_equal"], flush=True)  # fmt: skip
        if args.heads_first_only:
            record["shapes"].append(row)
            continue
        for tile, cap in CAPPED:
            entry: dict = {"tile": list(tile), "maxnreg": cap}
            da._decode_kernel = _RegisterCap(kernel, cap)
            try:
                with forced_tile_config(da, tile):
                    entry["err"] = errors(today(k8, v8), ref)
                    entry["us"] = graph_time_ms([partial(today, k8, v8)], 20, 3) * 1e3
                entry["TBps"] = fp8_bytes / entry["us"] / 1e6
            except Exception as exc:
                entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            finally:
                da._decode_kernel = kernel
            row["capped"].append(entry)
            print(batch, context, entry, flush=True)
        for two_terms in (False, True):
            for block_n, warps, stages in SWAP_TILES:
                entry = {"two_terms": two_terms, "tile": [block_n, warps, stages]}

                def run(q=q, k8=k8, v8=v8, table=table, lens=lens, context=context, e=entry):
                    bn, w, st = e["tile"]
                    return dfp8.paged_decode_attention_fp8_dots(
                        q, k8, v8, table, lens, scale, context, orient="swap", q_fp8=True,
                        two_terms=e["two_terms"], pv_fp16=True, block_n=bn, num_warps=w,
                        num_stages=st,
                    )  # fmt: skip

                try:
                    entry["err"] = errors(run(), ref)
                    entry["us"] = graph_time_ms([run], 20, 3) * 1e3
                    entry["TBps"] = fp8_bytes / entry["us"] / 1e6
                except Exception as exc:
                    entry["failed"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                row["swap"].append(entry)
                print(batch, context, entry, flush=True)
        timed = [e for e in row["capped"] + row["swap"] if "us" in e]
        if timed:
            row["best"] = min(timed, key=lambda e: e["us"])
        print(f"{batch}x{context}: bf16 {row['bf16_us']:.1f} us, float8 {row['fp8_us']:.1f}, "
              f"best {row.get('best')}", flush=True)  # fmt: skip
        record["shapes"].append(row)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
