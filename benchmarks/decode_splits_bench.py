"""Decode attention at batch 1/8/64 x context 1k/8k/32k, bf16 and float8 caches, Llama-3.1-8B
shapes (32 heads, 8 KV heads, head_dim 128, block 16), GPU time per call inside a CUDA graph:
the kernel with per-sequence partitions (issue 13, startup: one graph per split count) against the
kernel before it, and the grids a decode graph gives it.

    PYTHONPATH=. python3 benchmarks/decode_splits_bench.py --out decode_splits.json \
        [--before /tmp/decode_attention_before.py]

`--before` is the previous kiln/kernels/triton/decode_attention.py (e.g. `git show
37597ee:kiln/kernels/triton/decode_attention.py`), imported beside today's for a same-process A/B.
For every (cache, batch, context), in microseconds:
- `eager`: today's kernel as an eager step calls it (max_seq_len = the context).
- `graph`: today's kernel at the bucket of today's decode graphs (the Triton backend's
  decode_graph_seq_lens at max_model_len 131072): the grid a graph replay has.
- `one_graph`: today's kernel at max_seq_len 131072, the grid one graph per batch size would
  freeze (the saturated split count): what the early-exit programs cost at short contexts.
- `before_eager`, `before_graph`: the previous kernel at the context and at its power-of-two bucket.
Mixed rows put one long context beside seven of 512 tokens (batch 8: 8 splits): before, the short
ones sat in one partition each (sized from the long one); now each is split by its own length.
Each row also has the split counts and the max |difference| of every variant against `eager`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from types import ModuleType

import torch
from tile_sweep import graph_time_ms  # benchmarks/, the script's folder

from kiln.attention.triton_backend import TritonAttentionBackend
from kiln.kernels.triton import decode_attention as da
from kiln.kernels.triton._device import num_sms
from kiln.runtime.graph_runner import graph_batch_sizes

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_MODEL_LEN = 131072
BATCHES, CONTEXTS = (1, 8, 64), (1088, 8192, 32768)  # 1088: lat1k's mid-run context
MIXED = [(8, 8192), (8, 32768)]  # (batch, long context); the other rows hold 512 tokens
FP8 = torch.float8_e4m3fn


def load_before(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("decode_attention_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def inputs(seq_lens: list[int], gen: torch.Generator):
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
    q = torch.randn(len(seq_lens), HEADS, HEAD_DIM, device="cuda", generator=gen)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    return q.to(torch.bfloat16), k, v, table, lens


def graph_bucket(batch: int, context: int) -> int:
    """The context bucket today's decode graphs replay for this step (GraphRunner.lookup)."""
    padded = next(b for b in graph_batch_sizes(256) if b >= batch)
    buckets = TritonAttentionBackend().decode_graph_seq_lens(
        padded, KV_HEADS, MAX_MODEL_LEN, torch.device("cuda")
    )
    return next(c for c in buckets if c >= context)


def before_bucket(batch: int, context: int) -> int:
    """The previous backend's bucket: powers of two from 256, max_model_len without splits."""
    if da.choose_num_splits(batch, KV_HEADS, MAX_MODEL_LEN, num_sms(torch.device("cuda"))) == 1:
        return MAX_MODEL_LEN
    c = 256
    while c < context:
        c *= 2
    return min(c, MAX_MODEL_LEN)


def measure(seq_lens: list[int], before: ModuleType | None, label: str) -> list[dict]:
    gen = torch.Generator(device="cuda").manual_seed(len(seq_lens) * 7 + max(seq_lens))
    q, k, v, table, lens = inputs(seq_lens, gen)
    batch, context = len(seq_lens), max(seq_lens)
    sms = num_sms(q.device)
    grids = {
        "eager": context,
        "graph": graph_bucket(batch, context),
        "one_graph": MAX_MODEL_LEN,
    }
    rows = []
    for cache_name, (kc, vc) in (("bf16", (k, v)), ("fp8", (k.to(FP8), v.to(FP8)))):
        kv_bytes = 2 * sum(seq_lens) * KV_HEADS * HEAD_DIM * kc.element_size()
        row: dict = {"case": label, "cache": cache_name, "batch": batch, "seq_lens": seq_lens}
        calls = {
            name: (da, max_len, da.choose_num_splits(batch, KV_HEADS, max_len, sms))
            for name, max_len in grids.items()
        }
        if before is not None:
            old_bucket = before_bucket(batch, context)
            for name, max_len in (("before_eager", context), ("before_graph", old_bucket)):
                splits = da.choose_num_splits(batch, KV_HEADS, max_len, sms)  # the same policy
                calls[name] = (before, max_len, splits)
        ref = None
        for name, (module, max_len, splits) in calls.items():

            def fn(module=module, max_len=max_len, kc=kc, vc=vc):
                return module.paged_decode_attention(
                    q, kc, vc, table, lens, HEAD_DIM**-0.5, max_len
                )

            out = fn().float()
            ref = out if ref is None else ref
            us = graph_time_ms([fn], reps=20, replays=3) * 1e3
            row[name] = {
                "max_seq_len": max_len,
                "us": us,
                "GBps": kv_bytes / us / 1e3,
                "max_abs_diff_vs_eager": (out - ref).abs().max().item(),
            }
            row[name]["num_splits"] = splits
        print(
            f"{label} {cache_name}: "
            + ", ".join(f"{n} {r['us']:.1f} us" for n, r in row.items() if isinstance(r, dict)),
            flush=True,
        )
        rows.append(row)
    return rows


def graph_counts() -> dict:
    """Decode graphs at 8B shapes (max_num_seqs 256, max_model_len 131072) by each policy."""
    backend, device = TritonAttentionBackend(), torch.device("cuda")
    sizes = graph_batch_sizes(256)
    today = sum(
        len(backend.decode_graph_seq_lens(b, KV_HEADS, MAX_MODEL_LEN, device)) for b in sizes
    )
    sms = num_sms(device)
    previous = sum(
        1 if da.choose_num_splits(b, KV_HEADS, MAX_MODEL_LEN, sms) == 1 else 10 for b in sizes
    )
    return {"today": today, "before": previous, "one_per_batch_size": len(sizes)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="decode_splits.json")
    p.add_argument("--before", help="the previous decode_attention.py, for the A/B")
    args = p.parse_args()
    before = None
    if args.before:
        try:
            before = load_before(args.before)
        except Exception as exc:  # e.g. a helper it imports changed since: measure today's only
            print(f"--before {args.before} not loaded ({type(exc).__name__}: {exc})", flush=True)
    record = {
        "gpu": torch.cuda.get_device_name(),
        "tile_config_bf16": list(da._tile_config(BLOCK_SIZE, torch.device("cuda"))),
        "tile_config_fp8": list(da._tile_config(BLOCK_SIZE, torch.device("cuda"), kv_fp8=True)),
        "prefetch_fp8_v": da.PREFETCH_FP8_V,
        "graph_counts_8b": graph_counts(),
        "rows": [],
    }
    print("graphs at 8B shapes:", record["graph_counts_8b"], flush=True)
    for batch in BATCHES:
        for context in CONTEXTS:
            record["rows"] += measure([context] * batch, before, f"b{batch} ctx{context}")
    for batch, context in MIXED:
        lens = [context] + [512] * (batch - 1)
        record["rows"] += measure(lens, before, f"mixed b{batch} {context}+{batch - 1}x512")
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
