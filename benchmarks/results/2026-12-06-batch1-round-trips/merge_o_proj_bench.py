"""Batch 1's attention merge inside o_proj against the reduce kernel then o_proj.

    git apply benchmarks/results/2026-12-06-batch1-round-trips/merge_in_o_proj.patch
    PYTHONPATH=benchmarks:. python3 benchmarks/merge_o_proj_bench.py --out merge.json

Measured (this folder's call4, H100): the merged o_proj 15.2 us against 10.2 for the reduce then
o_proj at 16 partitions (12.9 against 10.9 at 4); batch 1 end to end unchanged (call3). The merge
was removed; the patch above has it (the per-column variant needed 352 KiB of shared memory at
the engine's tiles and never ran on the GPU).

Llama-3.1-8B at a 1k context: 32 heads of 128, 16 partitions a head (decode attention's split
count there on a 132-SM GPU), o_proj's 4096 x 4096 float8 weight with a static activation scale.
Each side timed as back-to-back calls in one CUDA graph, the weight's copies cycled (more bytes
than L2 holds, as a decode step streams them):
- `reduce`: decode_attention's reduce kernel alone;
- `o_proj`: small_batch_linear.fp8_linear on the merged row alone;
- `reduce+o_proj`: the two, as the engine ran them before (merge_attention_splits, fp8_linear);
- `merged`: merge_splits_fp8_linear, the partitions merged as the projection reads them (each
  column loading its head's log-sum-exps); `merged_per_head`: each head's loaded once.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
from tile_sweep import graph_time_ms  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton import small_batch_linear

HEADS, HEAD_DIM, PARTS, N = 32, 128, 16, 4096
L2_BYTES = 50 * 2**20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--parts", type=int, nargs="+", default=[PARTS, 8, 4])
    args = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    k = HEADS * HEAD_DIM
    copies = 2 * L2_BYTES // (N * k) + 1
    weights = []
    for _ in range(copies):
        w = torch.randn(N, k, generator=gen, device="cuda") * 0.02
        w_fp8, ws = reference.quantize_fp8(w, None)
        weights.append((w_fp8, ws.view(-1).contiguous()))
    scale = torch.tensor(0.02, device="cuda")
    dtype = torch.bfloat16
    results = {"device": torch.cuda.get_device_name(), "rows": []}
    for parts in args.parts:
        out = torch.randn(1, HEADS, parts, HEAD_DIM, generator=gen, device="cuda")
        lse = 4 * torch.randn(1, HEADS, parts, generator=gen, device="cuda")
        merged_row = triton_ops.merge_attention_splits(out, lse, dtype)

        def unfused(w, ws, out=out, lse=lse):
            row = triton_ops.merge_attention_splits(out, lse, dtype)
            return triton_ops.fp8_linear(row, w, ws, scale, None)

        def fused(w, ws, out=out, lse=lse, per_head=False):
            small_batch_linear.MERGE_PER_HEAD = per_head
            return triton_ops.merge_splits_fp8_linear(out, lse, w, ws, scale, None, dtype)

        def o_proj(w, ws, row=merged_row):
            return triton_ops.fp8_linear(row, w, ws, scale, None)

        want = unfused(*weights[0])
        err = max(
            (fused(*weights[0], per_head=h).float() - want.float()).abs().max().item()
            for h in (True,)
        )
        sides = {
            "reduce": [functools.partial(triton_ops.merge_attention_splits, out, lse, dtype)],
            "o_proj": [functools.partial(o_proj, *w) for w in weights],
            "reduce+o_proj": [functools.partial(unfused, *w) for w in weights],
            "merged_per_head": [functools.partial(fused, *w, per_head=True) for w in weights],
        }
        for name, calls in sides.items():
            us = graph_time_ms(calls, reps=4, replays=5) * 1000
            row = {"parts": parts, "side": name, "us": us, "max_abs_diff_vs_unfused": err}
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
