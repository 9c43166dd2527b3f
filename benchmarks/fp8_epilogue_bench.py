"""FP8 W8A8 at the rows where decode is batched and prefill is chunked (GPU): what the float8
SiLU-mul epilogue saves, and what the GEMM itself could still give at large M.

    PYTHONPATH=. python3 benchmarks/fp8_epilogue_bench.py --rows 512 8192 --out fp8_epilogue.json

Per row count, Llama-3.1-8B shapes, bf16 activations, times per call inside one CUDA graph
(tile_sweep.graph_time_ms, enough input copies that each call reads from HBM):
- "activation": the MLP's activation before down_proj as FP8 ran it before (silu_and_mul, then
  quantize_fp8) and now (silu_and_mul_quant_fp8), with the bytes each moves; the float8
  outputs compared byte for byte (they must be equal: the same rounding).
- "o_proj_quantize": quantize_fp8 on the attention output (4096 wide), the quantize kernel
  that remains before a GEMM above the small-batch rows (the attention's own epilogue could
  write float8; not built).
- "gemm": each projection as bf16 F.linear, as kiln's _scaled_mm now runs it (rowwise scales:
  per-token x per-channel, bf16 out), and tensorwise with a bf16 output (one scale per tensor
  on both sides: what a per-tensor weight scale with a static activation scale, ModelOpt's and
  TensorRT-LLM's FP8 checkpoints, would run; FACTS.md: 1.7-1.9x bf16 where rowwise is ~1.6x).
  TFLOP/s beside each.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from tile_sweep import graph_time_ms  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels.triton.fp8_gemm import quantize_fp8
from kiln.kernels.triton.silu_mul import silu_and_mul, silu_and_mul_quant_fp8

HIDDEN, INTERMEDIATE = 4096, 14336
SHAPES = {"qkv": (6144, HIDDEN), "o_proj": (HIDDEN, HIDDEN), "gate_up": (2 * INTERMEDIATE, HIDDEN),
          "down": (HIDDEN, INTERMEDIATE)}  # fmt: skip
L2_BYTES = 50 * 2**20


def copies_for(nbytes: int) -> int:
    return max(2, -(-3 * L2_BYTES // nbytes))


def time_us(fn, inputs: list) -> float:
    calls = [functools.partial(fn, *x) for x in inputs]
    return graph_time_ms(calls, reps=3, replays=5) * 1000


def activation_rows(rows: int, dev: str) -> dict:
    n = copies_for(rows * 2 * INTERMEDIATE * 2)
    xs = [
        (torch.randn(rows, 2 * INTERMEDIATE, device=dev, dtype=torch.bfloat16),) for _ in range(n)
    ]

    def before(x):
        return quantize_fp8(silu_and_mul(x), None)

    def after(x):
        return silu_and_mul_quant_fp8(x, None)

    static = torch.tensor(0.01, device=dev)  # made before capture: no copy inside the graph
    a, sa = before(*xs[0])
    b, sb = after(*xs[0])
    same = bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) and torch.equal(sa, sb))
    return {
        "before_us": time_us(before, xs),
        "silu_and_mul_us": time_us(silu_and_mul, xs),
        "after_us": time_us(after, xs),
        "static_after_us": time_us(lambda x: silu_and_mul_quant_fp8(x, static), xs),
        # Before: gate_up read, the bf16 activation written, read twice (absmax, then
        # quantize: the second often from L2), float8 written. After: gate_up read, float8.
        "before_bytes": rows * INTERMEDIATE * (4 + 2 + 2 * 2 + 1),
        "after_bytes": rows * INTERMEDIATE * (4 + 1),
        "float8_bytes_equal": same,
    }


def gemm_rows(rows: int, dev: str) -> dict:
    out = {}
    one = torch.ones((), device=dev)
    for name, (n, k) in SHAPES.items():
        w = 0.02 * torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        w8, ws = reference.quantize_fp8(w, None)
        ws = ws.view(1, n).contiguous()
        copies = copies_for(rows * k * 2 + n * k)
        xs = [torch.randn(rows, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        x8s = [quantize_fp8(x, None) for x in xs]
        flops = 2 * rows * n * k
        row = {
            "bf16_us": time_us(lambda x, w=w: F.linear(x, w), [(x,) for x in xs]),
            "rowwise_us": time_us(
                lambda x8, s, w8=w8, ws=ws: torch._scaled_mm(
                    x8, w8.t(), scale_a=s, scale_b=ws, out_dtype=torch.bfloat16
                ),
                x8s,
            ),
            "tensorwise_bf16_us": time_us(
                lambda x8, s, w8=w8, one=one: torch._scaled_mm(
                    x8, w8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16
                ),
                x8s,
            ),
        }
        for key in list(row):
            row[key.replace("_us", "_tflops")] = flops / row[key] / 1e6
        out[name] = row
        print(f"  {name:8s} " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[512, 8192])
    p.add_argument("--no-gemm", action="store_true")
    p.add_argument("--out", default="fp8_epilogue.json")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    results = {"gpu": torch.cuda.get_device_name(), "rows": {}}
    for rows in args.rows:
        act = activation_rows(rows, dev)
        xs = [(torch.randn(rows, HIDDEN, device=dev, dtype=torch.bfloat16), None)
              for _ in range(copies_for(rows * HIDDEN * 2))]  # fmt: skip
        entry = {"activation": act, "o_proj_quantize_us": time_us(quantize_fp8, xs)}
        print(f"rows {rows}: activation {json.dumps(act)}; o_proj quantize "
              f"{entry['o_proj_quantize_us']:.1f} us", flush=True)  # fmt: skip
        if not args.no_gemm:
            entry["gemm"] = gemm_rows(rows, dev)
        results["rows"][rows] = entry
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
