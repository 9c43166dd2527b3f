"""Decode attention over token-major against head-major KV blocks, at block sizes 16 and 64.

    PYTHONPATH=. python3 benchmarks/decode_kv_layout_sweep.py --out decode_kv_layout.json

Why: the engine's cache blocks are token-major ([block_size, num_kv_heads, head_dim]), so one
program's keys (one KV head) are 128-byte float8 rows 1 KiB apart (Llama-3.1-8B: 8 KV heads x
128 dims); TensorRT-LLM's and FlashInfer's paged caches keep a head's keys of a block
contiguous. Float8 decode attention runs at ~2.95 TB/s at 384 x 1.5k (docs/performance.md), and
neither its tiles, its registers nor float8 tensor-core dots moved it: this measures whether
the access pattern is what holds it. The kernel reads head-major blocks as a permuted view
(decode_attention._head_major), so both layouts run the same arithmetic (outputs bit-equal,
checked here) and only the addresses differ.

Llama-3.1-8B shapes, one layer, GPU time per call in a CUDA graph, each sequence's blocks placed
one after another (a fresh engine's allocator); the engine's tile and split choice, both grid
orders, and for the float8 cache a small tile sweep. Expectations beside the results
(benchmarks/results/2026-12-02-h200-pdl-batch1/call4/expected.md).
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from tile_sweep import forced_tile_config, graph_time_ms

from kiln.kernels.triton import decode_attention as da

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
SHAPES = [(384, 1500), (64, 4096), (1, 1024)]
BLOCK_SIZES = (16, 64)
TILE_SHAPES = [(384, 1500)]
TILES = [(32, 1, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2), (64, 2, 2)]
DEVICE = "cuda"  # module-level: a CPU dry run (interpreter, tiny shapes) sets "cpu" and an
Q_DTYPE = torch.bfloat16  # fp32 query (the interpreter has no inline asm for fp16 widening)


def caches(batch: int, context: int, block_size: int, dtype: torch.dtype, head_major: bool):
    """(k, v, block table): each sequence's blocks one after another. Head-major blocks are a
    permuted view of [blocks, KV heads, block_size, head_dim]; values are drawn in that order
    for both layouts from one seed, so the two layouts hold the same keys."""
    gen = torch.Generator(device=DEVICE).manual_seed(batch * 7 + context)
    blocks = -(-context // block_size)
    out = []
    for _ in range(2):
        raw = torch.randn(
            batch * blocks, KV_HEADS, block_size, HEAD_DIM, device=DEVICE, generator=gen
        ).to(dtype)
        out.append(raw.permute(0, 2, 1, 3) if head_major else raw.permute(0, 2, 1, 3).contiguous())
    table = torch.arange(batch * blocks, device=DEVICE, dtype=torch.int32).view(batch, blocks)
    return out[0], out[1], table


def run_one(batch, context, block_size, dtype, head_major, heads_first, tile=None) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    q = (torch.randn(batch, HEADS, HEAD_DIM, device=DEVICE, generator=gen) * 2.5).to(Q_DTYPE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    k, v, table = caches(batch, context, block_size, dtype, head_major)
    assert da._head_major(k) == head_major
    da.HEADS_FIRST_GRID = heads_first
    scale = HEAD_DIM**-0.5

    def call():
        return da.paged_decode_attention(q, k, v, table, lens, scale, context)

    if tile is None:
        out = call()
        ms = graph_time_ms([call], reps=max(2, int(40 / max(batch * context / 1e5, 0.5))))
    else:
        with forced_tile_config(da, tile):
            out = call()
            ms = graph_time_ms([call], reps=20)
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * k.element_size()
    return {
        "batch": batch, "context": context, "block_size": block_size,
        "cache": "fp8" if dtype == torch.float8_e4m3fn else "bf16",
        "layout": "head-major" if head_major else "token-major",
        "grid": "heads-first" if heads_first else "seqs-first",
        "tile": list(tile) if tile else "engine", "us": ms * 1e3,
        "tb_per_s": kv_bytes / (ms * 1e-3) / 1e12, "out": out,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_kv_layout.json")
    parser.add_argument("--budget-s", type=float, default=200.0, help="stops the tile sweep")
    args = parser.parse_args()
    t0 = time.monotonic()
    rows, mismatches = [], []
    fp8 = torch.float8_e4m3fn
    for batch, context in SHAPES:
        for block_size in BLOCK_SIZES:
            # bf16 in the engine's order for it (heads first); float8 in both
            for dtype, heads_first in ((fp8, False), (fp8, True), (torch.bfloat16, True)):
                pair = [
                    run_one(batch, context, block_size, dtype, hm, heads_first)
                    for hm in (False, True)
                ]
                if not torch.equal(pair[0]["out"], pair[1]["out"]):
                    mismatches.append([batch, context, block_size, str(dtype), heads_first])
                for r in pair:
                    r.pop("out")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    for batch, context in TILE_SHAPES:
        for block_size in BLOCK_SIZES:
            for tile in TILES:
                if time.monotonic() - t0 > args.budget_s:
                    break
                for hm in (False, True):
                    r = run_one(batch, context, block_size, fp8, hm, False, tile)
                    r.pop("out")
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "outputs_bit_equal_across_layouts": not mismatches,
        "mismatches": mismatches,
        "rows": rows,
        "seconds": time.monotonic() - t0,
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
