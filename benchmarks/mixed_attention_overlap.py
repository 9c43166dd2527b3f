"""A mixed step's attention with the decode kernel on a second stream beside the prefill kernel,
against the two kernels one after the other (Triton backend, Llama-3.1-8B heads, GPU).

    PYTHONPATH=. python3 benchmarks/mixed_attention_overlap.py --out mixed_attention_overlap.json

The decode kernel streams the KV cache (memory-bound) and the prefill kernel is bound by the
tensor cores, so side by side they can share the GPU. Shapes: session 5's profiled 2048/128 step
(4 fresh 2k prompts beside 240 decodes at ~2.1k), the 2048/128 steady state (2 prompts, 250
decodes) and a 1000/1000 mixed step (7 prompts of 1000, 376 decodes at 1.5k); bf16 and float8
caches. Each overlapped output is checked equal to the sequential one (the same kernels).
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from kiln.attention import triton_backend
from kiln.attention.backend import AttentionMetadata

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
SHAPES = {  # name: (prompt lengths, number of decodes, decode context)
    "2048x4_plus_240_decodes": ([2048] * 4, 240, 2112),
    "2048x2_plus_250_decodes": ([2048] * 2, 250, 2112),
    "1000x7_plus_376_decodes": ([1000] * 7, 376, 1500),
}


def make_step(prompts: list[int], num_decodes: int, context: int, cache_dtype: torch.dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_lens = [context] * num_decodes + prompts
    q_lens = [1] * num_decodes + prompts
    blocks = [-(-n // BLOCK_SIZE) for n in seq_lens]
    shape = (sum(blocks), BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16).to(cache_dtype)
    v = torch.randn(shape, device="cuda", generator=gen, dtype=torch.bfloat16).to(cache_dtype)
    perm = torch.randperm(sum(blocks), device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(blocks)), dtype=torch.int32, device="cuda")
    first = 0
    for r, b in enumerate(blocks):
        table[r, :b] = perm[first : first + b]
        first += b
    num_tokens = sum(q_lens)
    q = torch.randn((num_tokens, HEADS, HEAD_DIM), device="cuda", generator=gen)
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(num_tokens, dtype=torch.int64, device="cuda"),  # unused here
        query_start_loc=torch.tensor(
            [0, *itertools.accumulate(q_lens)], dtype=torch.int32, device="cuda"
        ),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        block_tables=table,
        num_decodes=num_decodes,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    return q.to(torch.bfloat16), k, v, metadata


def time_ms(fn, reps: int = 20) -> float:
    """GPU time per call from events on the current stream (eager: the overlap is disabled
    inside a graph capture); launch costs are ~3 kernels against ~1 ms of work."""
    for _ in range(3):
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
    p.add_argument("--out", default="mixed_attention_overlap.json")
    args = p.parse_args()
    backend = triton_backend.TritonAttentionBackend()
    rows = []
    for (name, (prompts, nd, context)), cache_dtype in itertools.product(
        SHAPES.items(), (torch.bfloat16, torch.float8_e4m3fn)
    ):
        q, k, v, metadata = make_step(prompts, nd, context, cache_dtype)
        scale = HEAD_DIM**-0.5

        def run(q=q, k=k, v=v, metadata=metadata, scale=scale):
            return backend.forward(q, k, v, metadata, scale)

        row = {"shape": name, "cache_dtype": str(cache_dtype).removeprefix("torch.")}
        results = {}
        for overlap in (False, True, False, True):  # twice each, interleaved: drift shows
            triton_backend.OVERLAP_MIXED_ATTENTION = overlap
            key = "overlap" if overlap else "sequential"
            row.setdefault(f"{key}_ms", []).append(time_ms(run))
            results[key] = run()
        torch.cuda.synchronize()
        row["outputs_equal"] = torch.equal(results["overlap"], results["sequential"])
        seq, ovl = min(row["sequential_ms"]), min(row["overlap_ms"])
        row["saved_fraction"] = 1 - ovl / seq
        print(
            f"{name} {row['cache_dtype']}: sequential {seq:.3f} ms, overlapped {ovl:.3f} ms "
            f"({row['saved_fraction']:.1%} saved), equal {row['outputs_equal']}",
            flush=True,
        )
        rows.append(row)
        del q, k, v
    triton_backend.OVERLAP_MIXED_ATTENTION = True
    with open(args.out, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
