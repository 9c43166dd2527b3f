"""Attention kernels over a float8 KV cache against the same kernels over bf16, at Llama-3.1-8B
shapes (GPU), and the decode kernel's tile configurations for a float8 cache.

    PYTHONPATH=. python3 benchmarks/kv_fp8_kernel_sweep.py --out kv_fp8_kernel_sweep.json

Decode: for each (batch, context), the time and achieved bandwidth (bytes of K/V the step must
read / time) with a bf16 cache and with a float8 cache at today's tile configuration, then every
(BLOCK_N, num_warps, num_stages) for float8. Prefill: bf16 against float8 cache at today's tiles.
Each output is checked against the bf16 run's (float8 rounding only: max abs error ~1e-1).
"""

from __future__ import annotations

import argparse
import itertools
import json
from functools import partial

import torch
from tile_sweep import forced_tile_config, graph_time_ms, sweep  # benchmarks/, the script's folder

from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton import prefill_attention as pa

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DECODE_SHAPES = [(384, 1500), (64, 4096), (1, 1024)]
DECODE_BLOCK_N = (64, 128, 256)
PREFILL_CONFIGS = list(itertools.product((64, 128), (64, 128), (4, 8), (1, 2, 3)))
PREFILL_SHAPES = {"4x2048_fresh": ([2048] * 4, 0), "1x512_after_6k": ([512], 6144)}
FP8 = torch.float8_e4m3fn


def paged(seq_lens: list[int], gen: torch.Generator):
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    perm = torch.randperm(sum(blocks), device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device="cuda")
    first = 0
    for r, b in enumerate(blocks):
        table[r, :b] = perm[first : first + b]
        first += b
    return k, v, table


def decode_inputs(batch: int, context: int):
    """bf16 and float8 caches of `batch` contexts of `context` tokens, a bf16 query, lengths."""
    gen = torch.Generator(device="cuda").manual_seed(batch)
    k, v, table = paged([context] * batch, gen)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.bfloat16)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    return k, v, k.to(FP8), v.to(FP8), q, table, lens


def time_ms(fn, reps: int = 20) -> float:
    """Mean of `reps` calls captured in one CUDA graph (GPU time, no launch overhead)."""
    return graph_time_ms([fn], reps)


def sweep_decode() -> list[dict]:
    rows = []
    for batch, context in DECODE_SHAPES:
        k, v, k8, v8, q, table, lens = decode_inputs(batch, context)
        scale = HEAD_DIM**-0.5

        def run(kc, vc, q=q, table=table, lens=lens, scale=scale, context=context):
            return da.paged_decode_attention(q, kc, vc, table, lens, scale, context)

        elems = 2 * batch * context * KV_HEADS * HEAD_DIM
        ref = run(k, v)
        row = {"batch": batch, "context": context}
        row["default_bf16"] = list(da._tile_config(BLOCK_SIZE, q.device))
        row["default_fp8"] = list(da._tile_config(BLOCK_SIZE, q.device, kv_fp8=True))
        row["bf16_ms"] = time_ms(partial(run, k, v))
        row["fp8_ms"] = time_ms(partial(run, k8, v8))
        row["fp8_max_abs_err_vs_bf16"] = (run(k8, v8).float() - ref.float()).abs().max().item()
        row["bf16_GBps"] = elems * 2 / row["bf16_ms"] / 1e6
        row["fp8_GBps"] = elems / row["fp8_ms"] / 1e6
        row["fp8_configs"] = sweep(
            da,
            itertools.product(DECODE_BLOCK_N, (4, 8), (1, 2, 3)),
            partial(run, k8, v8),
            time_ms,
            reference=ref,
            label=f"decode b={batch} ctx={context}",
        )
        best = min(row["fp8_configs"], key=lambda c: c["ms"])
        row["fp8_best"] = best
        print(
            f"decode b={batch} ctx={context}: bf16 {row['bf16_ms'] * 1e3:.1f} us "
            f"({row['bf16_GBps']:.0f} GB/s); fp8 {row['fp8_ms'] * 1e3:.1f} us "
            f"({row['fp8_GBps']:.0f} GB/s), best fp8 {best['config']} {best['ms'] * 1e3:.1f} us "
            f"({elems / best['ms'] / 1e6:.0f} GB/s); err {row['fp8_max_abs_err_vs_bf16']:.3f}",
            flush=True,
        )
        for c in sorted(row["fp8_configs"], key=lambda c: c["ms"])[:4]:
            print("   ", c["config"], f"{c['ms'] * 1e3:.1f} us")
        rows.append(row)
        del k, v, k8, v8
    return rows


def mixed_kv_decode(batch: int = 384, context: int = 1500) -> list[dict]:
    """Which operand is slow over float8: fp16 query, K and V each fp16 or float8 (float8 widens
    to fp16, so no other conversion is involved), at today's tiles."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    k, v, table = paged([context] * batch, gen)
    caches = {"fp16": (k.half(), v.half()), "fp8": (k.to(FP8), v.to(FP8))}
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", generator=gen, dtype=torch.float16)
    lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    elems = batch * context * KV_HEADS * HEAD_DIM  # per cache
    rows = []
    for cfg, k_name, v_name in itertools.product(((64, 4, 3), (128, 4, 2)), caches, caches):
        kc, vc = caches[k_name][0], caches[v_name][1]
        fn = partial(da.paged_decode_attention, q, kc, vc, table, lens, HEAD_DIM**-0.5, context)
        with forced_tile_config(da, cfg):
            ms = time_ms(fn)
        nbytes = elems * (kc.element_size() + vc.element_size())
        row = {"config": cfg, "k": k_name, "v": v_name, "batch": batch, "context": context}
        row.update(ms=ms, GBps=nbytes / ms / 1e6)
        print(
            f"mixed decode {cfg} K {k_name} V {v_name}: {ms * 1e3:.1f} us, {row['GBps']:.0f} GB/s"
        )
        rows.append(row)
    return rows


def prefetch_ab() -> list[dict]:
    """Float8 decode with V loaded a tile ahead (da.PREFETCH_FP8_V) against without, at today's
    tiles, and the tiles with it; bf16 at the same shape for the bandwidth it reaches."""
    rows = []
    for batch, context in DECODE_SHAPES:
        k, v, k8, v8, q, table, lens = decode_inputs(batch, context)

        def run(kc, vc, q=q, table=table, lens=lens, context=context):
            return da.paged_decode_attention(q, kc, vc, table, lens, HEAD_DIM**-0.5, context)

        elems = 2 * batch * context * KV_HEADS * HEAD_DIM
        row = {"batch": batch, "context": context, "bf16_ms": time_ms(partial(run, k, v))}
        for prefetch in (False, True):
            da.PREFETCH_FP8_V = prefetch
            name = "prefetch" if prefetch else "no_prefetch"
            row[f"fp8_{name}_ms"] = time_ms(partial(run, k8, v8))
            row[f"fp8_{name}_max_abs_err_vs_bf16"] = (
                (run(k8, v8).float() - run(k, v).float()).abs().max().item()
            )
        row["fp8_prefetch_configs"] = sweep(
            da,
            itertools.product((32, 64, 128), (4, 8), (1, 2, 3)),
            partial(run, k8, v8),
            time_ms,
            reference=run(k, v),
            label=f"prefetch decode b={batch} ctx={context}",
        )
        for key in ("bf16", "fp8_no_prefetch", "fp8_prefetch"):
            nbytes = elems * (2 if key == "bf16" else 1)
            row[f"{key}_GBps"] = nbytes / row[f"{key}_ms"] / 1e6
        best = min(row["fp8_prefetch_configs"], key=lambda c: c["ms"])
        row["fp8_prefetch_best"] = best
        print(
            f"decode b={batch} ctx={context}: bf16 {row['bf16_ms'] * 1e3:.1f} us "
            f"({row['bf16_GBps']:.0f} GB/s); fp8 without prefetch "
            f"{row['fp8_no_prefetch_ms'] * 1e3:.1f} us ({row['fp8_no_prefetch_GBps']:.0f} GB/s), "
            f"with {row['fp8_prefetch_ms'] * 1e3:.1f} us ({row['fp8_prefetch_GBps']:.0f} GB/s); "
            f"best with prefetch {best['config']} {best['ms'] * 1e3:.1f} us",
            flush=True,
        )
        rows.append(row)
        del k, v, k8, v8
    da.PREFETCH_FP8_V = True
    return rows


def compare_prefill() -> list[dict]:
    rows = []
    for name, (lens, prefix) in PREFILL_SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(1)
        seq_lens = [n + prefix for n in lens]
        k, v, table = paged(seq_lens, gen)
        k8, v8 = k.to(FP8), v.to(FP8)
        q = torch.randn(
            (sum(lens), HEADS, HEAD_DIM), device="cuda", generator=gen, dtype=torch.bfloat16
        )
        qsl = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
        sl = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        flops = sum(4 * n * (prefix + (n + 1) / 2) * HEAD_DIM * HEADS for n in lens)

        def run(kc, vc, q=q, table=table, qsl=qsl, sl=sl, lens=lens, seq_lens=seq_lens):
            scale = HEAD_DIM**-0.5
            return pa.paged_prefill_attention(
                q, kc, vc, table, qsl, sl, scale, max(lens), max(seq_lens)
            )

        row = {"shape": name, "bf16_ms": time_ms(partial(run, k, v), 5)}
        row["fp8_configs"] = sweep(
            pa, PREFILL_CONFIGS, partial(run, k8, v8), partial(time_ms, reps=5), label=name
        )
        for c in row["fp8_configs"]:
            c["TFLOPs"] = flops / c["ms"] / 1e9
        for c in sorted(row["fp8_configs"], key=lambda c: c["ms"])[:4]:
            print("    prefill fp8", c["config"], f"{c['ms']:.3f} ms {c['TFLOPs']:.0f} TFLOP/s")
        row["fp8_ms"] = time_ms(partial(run, k8, v8), 5)
        row["fp8_max_abs_err_vs_bf16"] = (
            (run(k8, v8).float() - run(k, v).float()).abs().max().item()
        )
        row["bf16_TFLOPs"] = flops / row["bf16_ms"] / 1e9
        row["fp8_TFLOPs"] = flops / row["fp8_ms"] / 1e9
        print(f"prefill {name}: {row}", flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="kv_fp8_kernel_sweep.json")
    p.add_argument("--mixed-only", action="store_true", help="only the K/V dtype experiment")
    p.add_argument("--prefetch-only", action="store_true", help="only the V-prefetch A/B")
    args = p.parse_args()
    if args.prefetch_only:
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "prefetch_ab": prefetch_ab()}, f)
        return
    record = {"gpu": torch.cuda.get_device_name(), "mixed_kv_decode": mixed_kv_decode()}
    if args.mixed_only:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        return
    record["decode"] = sweep_decode()
    record["prefill"] = compare_prefill()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
