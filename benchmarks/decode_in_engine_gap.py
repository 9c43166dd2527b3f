"""Why float8 decode attention is slower inside the engine's decode step than alone.

    PYTHONPATH=.:benchmarks python3 benchmarks/decode_in_engine_gap.py --out decode_gap.json

At 512 x 192 (128/128's steady state, Llama-3.1-8B shapes) the kernel took 102.3 us a layer in
the engine's step and 83.4 alone on one compact cache in the same run
(results/2026-12-02-h200-decode-512-engine-vs-micro/). This times the same kernel, GPU time per
layer in a CUDA graph, as the step differs from the sweep one way at a time:

- `one-layer`: the sweep's setup, one layer's cache called over and over;
- `layers`: 32 layers' caches (separate tensors, as ModelRunner.kv_caches), one call each in
  order, as a step runs them;
- `layers-pool`: the same with each layer's tensors as large as the engine's pool
  (--pool-gb over all layers; the used blocks at the start, as a fresh allocator hands them
  out), so the step's accesses span the same address range;
- `layers-gemm`: `layers` with a decoder layer's four projections (bf16 GEMMs at Llama-3.1-8B's
  shapes) before each call, as the step runs them: they evict L2 between attention calls, and
  they hold the GPU at its power cap, where the SM clock drops (~1,718 MHz against 1,980 in a
  1000/1000 run), which a latency-bound kernel feels and a one-layer benchmark does not;
- `layers-grow`: `layers` with contexts spread over 192-212 (the profile's 20 steps) instead of
  192 everywhere.

Expectations: benchmarks/decode_in_engine_gap_expected.md.
"""

from __future__ import annotations

import argparse
import json

import torch
from tile_sweep import graph_time_ms

from kiln.kernels.triton import decode_attention as da

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, LAYERS = 32, 8, 128, 16, 32
DEVICE = "cuda"  # a CPU dry run (interpreter, tiny shapes) sets "cpu", an fp32 query and
Q_DTYPE = torch.bfloat16  # LAYERS = 2
FP8 = torch.float8_e4m3fn


def layer_caches(batch: int, context: int, pool_blocks: int, gen: torch.Generator):
    """One layer's K and V: pool_blocks blocks, the first batch * ceil(context / 16) filled."""
    used = batch * -(-context // BLOCK_SIZE)
    shape = (max(pool_blocks, used), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    caches = []
    for _ in range(2):
        cache = torch.empty(shape, dtype=FP8, device=DEVICE)  # past `used`: never read
        cache[:used] = torch.randn((used, *shape[1:]), generator=gen, device=DEVICE).to(FP8)
        caches.append(cache)
    return caches


def case(name: str, batch: int, context: int, pool_gb: float) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    blocks = -(-(context + 20) // BLOCK_SIZE)  # room for the grown contexts
    table = torch.arange(batch * blocks, device=DEVICE, dtype=torch.int32).view(batch, blocks)
    q = (torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device=DEVICE) * 2.5).to(Q_DTYPE)
    if name == "layers-grow":
        lens = (context + torch.arange(batch, device=DEVICE) % 21).to(torch.int32)
    else:
        lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    layers = 1 if name == "one-layer" else LAYERS
    pool_blocks = 0
    if name == "layers-pool":  # K and V of every layer share pool_gb
        pool_blocks = int(pool_gb * 2**30 / (2 * LAYERS * BLOCK_SIZE * KV_HEADS * HEAD_DIM))
    caches = [layer_caches(batch, context + 20, pool_blocks, gen) for _ in range(layers)]
    scale = HEAD_DIM**-0.5
    max_len = context + 20
    calls = []
    projections = []
    if name == "layers-gemm":  # (input width, output width): qkv, o_proj, gate_up, down
        for k_in, n_out in ((4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)):
            a = torch.randn(batch, k_in, generator=gen, device=DEVICE).to(Q_DTYPE)
            w = torch.randn(k_in, n_out, generator=gen, device=DEVICE).to(Q_DTYPE)
            projections.append(lambda a=a, w=w: a @ w)
    for k, v in caches:
        calls.extend(projections)
        calls.append(
            lambda k=k, v=v: da.paged_decode_attention(q, k, v, table, lens, scale, max_len)
        )
    ms = graph_time_ms(calls, reps=4 if layers > 1 else 64, replays=3)
    per_call = ms * len(calls) / layers  # graph_time_ms divides by every call
    gemm_ms = 0.0
    if projections:  # alone, per layer: cooler (faster) than between calls, so us_per_layer
        # below is an upper bound of attention's time there
        gemm_ms = graph_time_ms(projections, reps=32, replays=3) * len(projections)
    return {
        "case": name, "batch": batch, "context": context, "layers": layers,
        "pool_blocks_per_layer": pool_blocks or None,
        "us_per_layer": (per_call - gemm_ms) * 1e3,
        "gemm_us": gemm_ms * 1e3 if gemm_ms else None,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="decode_gap.json")
    parser.add_argument("--pool-gb", type=float, default=96.0, help="the engine's KV budget")
    parser.add_argument("--shapes", default="512x192,384x1500,768x1500")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        batch, context = map(int, shape.split("x"))
        for name in ("one-layer", "layers", "layers-pool", "layers-gemm", "layers-grow"):
            row = case(name, batch, context, args.pool_gb)
            rows.append(row)
            print(json.dumps(row), flush=True)
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    record = {"gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "rows": rows}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
