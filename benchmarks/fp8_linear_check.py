"""FP8 W8A8 linear on the GPU: the Triton/_scaled_mm path against its reference twin (accuracy)
and against bf16 F.linear (speed), at Llama-3.1-8B's projection shapes.

    PYTHONPATH=. python3 benchmarks/fp8_linear_check.py --out fp8_linear.json

Weights are random at a trained model's scale (std 0.02), quantized per output channel as
kiln.quantization.fp8 does; activations are random normal. Times are per call inside one CUDA
graph (tile_sweep.graph_time_ms), cycling over enough weight copies that every call reads its
weight from HBM, as a decode step does.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch
import torch.nn.functional as F
from tile_sweep import graph_time_ms  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops

SHAPES = {
    "qkv": (6144, 4096),
    "o_proj": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
L2_BYTES = 50 * 2**20


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / reference.FP8_E4M3_MAX).clamp(min=1e-12)
    q = (w.float() / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q, scale


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64, 256, 2048, 8192])
    p.add_argument("--out", default="fp8_linear.json")
    args = p.parse_args()
    torch.manual_seed(0)
    results = []
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
        weights = [
            torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)
        ]
        quantized = [quantize_weight(w) for w in weights]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            static = (x.float().abs().max() / reference.FP8_E4M3_MAX).reshape(())
            wq, ws = quantized[0]
            row = {"shape": name, "n": n, "k": k, "rows": m}
            exact = F.linear(x.double(), weights[0].double())
            for mode, scale in (("dynamic", None), ("static", static)):
                fast = triton_ops.fp8_linear(x, wq, ws, scale, None)
                ref = reference.fp8_linear(x, wq, ws, scale, None)
                row[f"{mode}_vs_reference_rel_err"] = rel_err(fast, ref)
                row[f"{mode}_vs_exact_rel_err"] = rel_err(fast, exact)
                calls = [
                    functools.partial(triton_ops.fp8_linear, x, q, s, scale, None)
                    for q, s in quantized
                ]
                row[f"{mode}_us"] = graph_time_ms(calls, reps=4, replays=5) * 1000
            row["bf16_vs_exact_rel_err"] = rel_err(F.linear(x, weights[0]), exact)
            row["bf16_us"] = (
                graph_time_ms(
                    [functools.partial(F.linear, x, w) for w in weights], reps=4, replays=5
                )
                * 1000
            )
            row["speedup_dynamic"] = row["bf16_us"] / row["dynamic_us"]
            row["speedup_static"] = row["bf16_us"] / row["static_us"]
            results.append(row)
            r = row
            print(
                f"{name:8s} M={m:5d}  bf16 {r['bf16_us']:8.1f} us  "
                f"fp8 dyn {r['dynamic_us']:8.1f} ({r['speedup_dynamic']:.2f}x)  "
                f"static {r['static_us']:8.1f} ({r['speedup_static']:.2f}x)  "
                f"vs ref {r['dynamic_vs_reference_rel_err']:.1e}/"
                f"{r['static_vs_reference_rel_err']:.1e}  "
                f"vs exact {r['dynamic_vs_exact_rel_err']:.1e} "
                f"(bf16 {r['bf16_vs_exact_rel_err']:.1e})"
            )
    with open(args.out, "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "results": results,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
