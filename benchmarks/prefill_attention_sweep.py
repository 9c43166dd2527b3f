"""Tile configurations of kiln's prefill attention kernel at Llama-3.1-8B shapes (GPU).

    PYTHONPATH=. python3 benchmarks/prefill_attention_sweep.py --out sweep.json

For each workload shape (fresh prompts packed in one 8k-token step, one 2k prompt, a chunk after a
cached prefix) times every (BLOCK_M, BLOCK_N, num_warps, num_stages) against the configuration
`_tile_config` picks today, and checks each output against that one.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
from tile_sweep import sweep  # benchmarks/, the script's own folder

from kiln.kernels.triton import prefill_attention as pa

SHAPES = {  # name: (prompt lengths, cached prefix per prompt)
    "4x2048_fresh": ([2048] * 4, 0),
    "1x2048_fresh": ([2048], 0),
    "8x1000_fresh": ([1000] * 8, 0),
    "1x512_after_6k": ([512], 6144),
}
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def make_inputs(lens: list[int], prefix: int | list[int]) -> tuple:
    """A paged bf16 cache holding each chunk's prefix and itself (blocks in random order), and
    the queries; `prefix` is one cached prefix length for every chunk, or one per chunk."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    prefixes = prefix if isinstance(prefix, list) else [prefix] * len(lens)
    seq_lens = [n + p for n, p in zip(lens, prefixes, strict=True)]
    blocks_per_seq = [-(-s // BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    v_cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros((len(lens), max(blocks_per_seq)), dtype=torch.int32, device="cuda")
    first = 0
    for r, b in enumerate(blocks_per_seq):
        table[r, :b] = perm[first : first + b]
        first += b
    q = torch.randn(
        (sum(lens), HEADS, HEAD_DIM), device="cuda", dtype=torch.bfloat16, generator=gen
    )
    qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q, k_cache, v_cache, table, qsl, sl, max(lens), max(seq_lens)


def time_ms(fn, reps: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="prefill_attention_sweep.json")
    args = p.parse_args()
    results = []
    for name, (lens, prefix) in SHAPES.items():
        inputs = make_inputs(lens, prefix)
        scale = HEAD_DIM**-0.5
        flops = sum(4 * n * (prefix + (n + 1) / 2) * HEAD_DIM * HEADS for n in lens)

        def run(inputs=inputs, scale=scale):
            q, k, v, table, qsl, sl, mq, ms = inputs
            return pa.paged_prefill_attention(q, k, v, table, qsl, sl, scale, mq, ms)

        chosen = pa._tile_config(HEAD_DIM, max(lens), HEADS, len(lens), torch.device("cuda"))
        ref = run()
        base = time_ms(run)
        row = {"shape": name, "default": list(chosen), "default_ms": base}
        configs = itertools.product((64, 128), (64, 128), (4, 8), (3, 4))
        row["configs"] = sweep(pa, configs, run, time_ms, reference=ref, label=name)
        best = min(row["configs"], key=lambda c: c["ms"])
        row["best"] = best
        print(
            f"{name}: default {chosen} {base:.3f} ms ({flops / base / 1e9:.0f} TFLOP/s); best "
            f"{best['config']} {best['ms']:.3f} ms ({flops / best['ms'] / 1e9:.0f} TFLOP/s), "
            f"err {best['max_abs_err']:.3g}"
        )
        for c in sorted(row["configs"], key=lambda c: c["ms"])[:5]:
            print("   ", c["config"], f"{c['ms']:.3f} ms")
        results.append(row)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
