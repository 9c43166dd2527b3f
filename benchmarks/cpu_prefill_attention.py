"""CPU prefill attention: torch's SDPA on 4-D inputs (a batch of one, what
reference.paged_prefill_attention passes since 2026-12-04) against the 3-D inputs it passed
before, side by side in one process:

1. the SDPA call alone at SmolLM2's heads (9 query, 3 KV, head_dim 64): a fresh 2048-token
   prompt (causal), a 1085-token chunk after 1084 cached tokens and a 121-token one (masked),
   fp32 and bf16; milliseconds (median of --reps) and the largest error against fp64;
2. the build's held-out perplexity of the embedded SmolLM2 (kiln.builder.accuracy.measure,
   three articles), each variant --rounds times, alternated;
3. a checked `kiln build --quantization fp8-dynamic` of it (in-process, fresh cache), each once.

The 3-D variant is the same function with the batch dimension taken off inside the SDPA call
(prefill's two forms: causal, or a 2-D mask; decode's calls are untouched).

    OMP_NUM_THREADS=2 PYTHONPATH=. python3 benchmarks/cpu_prefill_attention.py --out FILE.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from kiln.kernels import reference

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
SHAPES = ((2048, 2048), (1085, 2169), (121, 2169))  # (query tokens, context tokens)


def _sdpa_3d(q, k, v, attn_mask=None, is_causal=False, **kwargs):
    """The call as it was: prefill's batch-of-one inputs without their batch dimension."""
    prefill = is_causal or (attn_mask is not None and attn_mask.dim() == 2)
    if prefill and q.dim() == 4 and q.shape[0] == 1:
        return F.scaled_dot_product_attention(
            q[0], k[0], v[0], attn_mask=attn_mask, is_causal=is_causal, **kwargs
        )[None]
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs
    )


class _Functional3d:
    """torch.nn.functional with _sdpa_3d as its scaled_dot_product_attention."""

    scaled_dot_product_attention = staticmethod(_sdpa_3d)

    def __getattr__(self, name: str) -> object:
        return getattr(F, name)


@contextlib.contextmanager
def attention(variant: str) -> Iterator[None]:
    """reference.paged_prefill_attention as committed ("4d") or with 3-D SDPA inputs ("3d")."""
    if variant == "4d":
        yield
        return
    real = reference.F
    reference.F = _Functional3d()
    try:
        yield
    finally:
        reference.F = real


def sdpa_times(reps: int) -> list[dict]:
    rows = []
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for q_len, seq_len in SHAPES:
            q = torch.randn(HEADS, q_len, HEAD_DIM, dtype=dtype)
            k = torch.randn(KV_HEADS, seq_len, HEAD_DIM, dtype=dtype)
            v = torch.randn(KV_HEADS, seq_len, HEAD_DIM, dtype=dtype)
            causal = q_len == seq_len
            mask = None
            if not causal:
                mask = (
                    torch.arange(seq_len)[None, :]
                    <= torch.arange(seq_len - q_len, seq_len)[:, None]
                )
            args = dict(attn_mask=mask, is_causal=causal, enable_gqa=True)
            want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), **args)
            row = {"dtype": str(dtype).removeprefix("torch."), "q_len": q_len, "seq_len": seq_len}
            for name, inputs in (("3d", (q, k, v)), ("4d", (q[None], k[None], v[None]))):
                out = F.scaled_dot_product_attention(*inputs, **args).reshape(want.shape)
                times = []
                for _ in range(reps):
                    start = time.perf_counter()
                    F.scaled_dot_product_attention(*inputs, **args)
                    times.append((time.perf_counter() - start) * 1000)
                row[f"{name}_ms"] = statistics.median(times)
                row[f"{name}_max_err"] = (out.double() - want).abs().max().item()
            row["speedup"] = row["3d_ms"] / row["4d_ms"]
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def perplexity_times(rounds: int) -> list[dict]:
    from kiln.builder.accuracy import measure
    from kiln.llm import LLM

    llm = LLM(enable_prefix_caching=False)
    rows = []
    for _ in range(rounds):
        for variant in ("3d", "4d"):
            with attention(variant):
                start = time.perf_counter()
                ppl = measure(llm, None)
                row = {"variant": variant, "seconds": time.perf_counter() - start, **ppl}
            print(json.dumps(row), flush=True)
            rows.append(row)
    llm.shutdown()
    return rows


def build_times() -> list[dict]:
    from kiln.builder.build import BuildOptions, build_engine

    rows = []
    for variant in ("3d", "4d"):
        with tempfile.TemporaryDirectory() as work, attention(variant):
            options = BuildOptions(quantization="fp8-dynamic", max_ppl_increase=100.0)
            start = time.perf_counter()
            manifest = build_engine(None, os.path.join(work, "engine"), options, None)
            row = {
                "variant": variant,
                "seconds": time.perf_counter() - start,
                "word_perplexity_increase_pct": manifest.accuracy["word_perplexity_increase_pct"],
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="cpu_prefill_attention.json")
    args = p.parse_args()
    revision = subprocess.run(
        ["git", "describe", "--always", "--dirty"], capture_output=True, text=True
    ).stdout.strip()
    record = {
        "command": "benchmarks/cpu_prefill_attention.py "
        + " ".join(f"--{k} {v}" for k, v in vars(args).items()),
        "git_revision": revision,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu": platform.processor() or platform.machine(),
        "load_average": os.getloadavg(),
        "sdpa": sdpa_times(args.reps),
        "held_out_perplexity": perplexity_times(args.rounds),
        "checked_fp8_build": build_times(),
    }
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
