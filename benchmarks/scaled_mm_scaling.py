"""Which `torch._scaled_mm` form runs the FP8 GEMMs of a large step fastest (H200).

    PYTHONPATH=. python3 benchmarks/scaled_mm_scaling.py --out scaled_mm_scaling.json

kiln's FP8 GEMMs from 256 rows on are rowwise-scaled (a per-token [M, 1] and a per-channel
[1, N] scale in the epilogue, bf16 out). In the H200 profiles they run at 1,260-1,330 TFLOP/s
(64-67% of the dense FP8 peak) through cuBLAS's `nvjet ... ovscale` kernels. Times the same
GEMM, at Llama-3.1-8B's four projection shapes and 512 / 2048 / 8192 rows, as:
  rowwise             (today)
  tensorwise          scalar scales (a per-tensor weight scale and a static input scale: ModelOpt's
                      FP8 checkpoints, TensorRT-LLM's headline setup), bf16 out
  rowwise_fast        rowwise with use_fast_accum=True (Hopper's float8 accumulation without
                      periodic promotion to fp32)
  tensorwise_fast     both
and bf16 F.linear, each inside a CUDA graph, weights cycled past the L2. The error of each
against the fp32 product of the same float8 values is recorded (fast accumulation's cost), so
the engine format and the GEMM call can be chosen from one run.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from fp8_linear_check import L2_BYTES, SHAPES, quantize_weight, rel_err
from tile_sweep import graph_time_ms  # benchmarks/, the script's folder

ROWS = (512, 2048, 8192)
FORMS = ("rowwise", "tensorwise", "rowwise_fast", "tensorwise_fast")


def _gemm(form: str, x8, x_scale_rows, x_scale, w8, w_scale_cols, w_scale):
    fast = form.endswith("_fast")
    if form.startswith("rowwise"):
        return torch._scaled_mm(
            x8, w8.t(), scale_a=x_scale_rows, scale_b=w_scale_cols, out_dtype=torch.bfloat16,
            use_fast_accum=fast,
        )  # fmt: skip
    return torch._scaled_mm(
        x8, w8.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16, use_fast_accum=fast
    )


def _measure(name: str, n: int, k: int, rows: int, w8s: list, wbf: list, w_cols, w_scale) -> dict:
    """One shape at one row count: every form's time and error."""
    x = torch.randn(rows, k, device="cuda")
    x_scale = (x.abs().amax() / 448.0).reshape(())
    x8 = (x / x_scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    x_scale_rows = x_scale.expand(rows, 1).contiguous()
    w8 = w8s[0]
    exact = (x8.float() * x_scale) @ (w8.float() * w_cols.view(n, 1)).t()
    exact_tensor = (x8.float() * x_scale) @ (w8.float() * w_scale).t()
    entry: dict = {"shape": name, "n": n, "k": k, "rows": rows}
    flops = 2 * rows * n * k
    xb = x.bfloat16()
    entry["bf16_us"] = graph_time_ms([lambda w=w: F.linear(xb, w) for w in wbf], 4) * 1e3
    for form in FORMS:
        try:
            out = _gemm(form, x8, x_scale_rows, x_scale, w8, w_cols, w_scale)
            ref = exact_tensor if form.startswith("tensorwise") else exact
            entry[f"{form}_rel_err"] = rel_err(out, ref)
            calls = [
                lambda w=w, form=form: _gemm(form, x8, x_scale_rows, x_scale, w, w_cols, w_scale)
                for w in w8s
            ]
            us = graph_time_ms(calls, 4) * 1e3
            entry[f"{form}_us"] = us
            entry[f"{form}_TFLOPs"] = flops / us / 1e6
        except Exception as exc:  # a form this torch/cuBLAS does not take
            entry[f"{form}_failed"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    return entry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="scaled_mm_scaling.json")
    args = parser.parse_args()
    torch.manual_seed(0)
    record: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        copies = max(1, -(-3 * L2_BYTES // (n * k)))  # float8 bytes: every call from HBM
        w8, w_scale_cols = quantize_weight(w)
        w8s = [w8.clone() for _ in range(copies)]
        wbf = [w.bfloat16() for _ in range(copies)]
        w_scale = w_scale_cols.max().reshape(())  # a per-tensor weight scale, for the timing
        w_cols = w_scale_cols.view(1, n).contiguous()
        for rows in ROWS:
            entry = _measure(name, n, k, rows, w8s, wbf, w_cols, w_scale)
            print(json.dumps(entry), flush=True)
            record["rows"].append(entry)
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
