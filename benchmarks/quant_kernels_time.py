"""The FP8 activation-quantizing kernels' GPU time, whichever kiln tree is on PYTHONPATH.

    PYTHONPATH=<tree> python3 benchmarks/quant_kernels_time.py --out quant_TAG.json \
        [--codes codes_TAG.pt] [--compare codes_OTHER.pt]

Llama-3.1-8B shapes (hidden 4096, intermediate 14336) at 512 and 8192 rows, dynamic (per-row)
and static scales, GPU time in a CUDA graph: SiLU-mul + quantize, add + RMSNorm + quantize,
quantize_fp8. Run once per tree (the A/B of two trees' arithmetic: `--codes` saves this tree's
float8 outputs, `--compare` counts the codes that differ from another tree's on the same inputs).
"""

from __future__ import annotations

import argparse
import json

import torch
from tile_sweep import graph_time_ms  # benchmarks/, the script's folder

from kiln.kernels.triton.fp8_gemm import quantize_fp8
from kiln.kernels.triton.rms_norm import add_rms_norm_quant_fp8
from kiln.kernels.triton.silu_mul import silu_and_mul_quant_fp8

HIDDEN, INTER = 4096, 14336


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--codes")
    parser.add_argument("--compare")
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    record: dict = {"gpu": torch.cuda.get_device_name(), "rows": []}
    codes: dict = {}
    static = torch.tensor(0.05, device="cuda")
    weight = (1 + 0.1 * torch.randn(HIDDEN, device="cuda", generator=gen)).bfloat16()
    for rows in (512, 8192):
        gate_up = torch.randn(rows, 2 * INTER, device="cuda", generator=gen).bfloat16()
        x = torch.randn(rows, HIDDEN, device="cuda", generator=gen).bfloat16()
        res = torch.randn(rows, HIDDEN, device="cuda", generator=gen).bfloat16()
        calls = {
            "silu_mul_quant": lambda s, g=gate_up: silu_and_mul_quant_fp8(g, s),
            "add_rms_norm_quant": lambda s, x=x, r=res: add_rms_norm_quant_fp8(
                x, r, weight, 1e-5, s
            ),
            "quantize_fp8": lambda s, x=x: quantize_fp8(x, s),
        }  # fmt: skip
        for name, fn in calls.items():
            for mode, scale in (("dynamic", None), ("static", static)):
                key = f"{name}/{mode}/{rows}"
                us = graph_time_ms([lambda fn=fn, scale=scale: fn(scale)], 20, 3) * 1e3
                codes[key] = fn(scale)[0].view(torch.uint8).cpu()
                record["rows"].append({"kernel": key, "us": us})
                print(key, round(us, 2), flush=True)
    if args.codes:
        torch.save(codes, args.codes)
    if args.compare:
        other = torch.load(args.compare)
        for row in record["rows"]:
            a, b = codes[row["kernel"]], other[row["kernel"]]
            row["codes_differing"] = int((a != b).sum())
            row["codes"] = a.numel()
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
