"""Where outlier columns' unfused cost goes: the float8 GEMM at K + 16 against K, and the pieces
around it.

    PYTHONPATH=benchmarks:. python3 benchmarks/fp8_gemm_k_alignment.py --out k_alignment.json

benchmarks/outlier_columns_cost.py found static fp8's blocks with 16 outlier columns 1.4-4.4x
slower at 1-8192 rows (results/2026-12-05-h200-outlier-cost/), far past what 16 more columns'
work (+0.1-0.4%) and three small torch kernels explain, e.g. the MLP at 8192 rows 2181 -> 3009 us.
This times, at Llama-3.1-8B's four projections (inside CUDA graphs, static scales, the engine's
ops.fp8_matmul: since 2026-12-05's seventh call the small-batch kernel up to 8 rows, unit-scale
_scaled_mm + epilogue below 256 rows, rowwise above):

- the GEMM with K, K + 16, K + 32, K + 64 and K + 128 columns (the input and the weight both
  that long), so a K alignment penalty shows apart from the work;
- at K, the unfused path's other pieces: the bf16 norm, the quantize kernel, the remainders'
  gather / subtraction (remainder_fp8) and the concatenation; and the fused path's: the norm
  and the quantize kernels writing the 16 remainders themselves (`channels=`).
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln.kernels import reference

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # fmt: skip
ROWS = (1, 16, 256, 1000, 8192)
EXTRA = (0, 16, 32, 64, 128)
SCALE = 4.0 / 448.0


def _row(ops, time_ms, name: str, weights: dict, x: torch.Tensor, scale: torch.Tensor) -> dict:
    """One shape at x's rows: the GEMM at each K + e, and the unfused pieces at K."""
    from kiln.kernels.reference import fp8_remainder as remainder_fp8

    n, k = weights[0].shape
    w_scale = torch.full((n,), 1e-2, device=x.device)
    row: dict = {"shape": name, "n": n, "k": k, "rows": x.shape[0], "gemm_us": {}}
    for e, weight in weights.items():
        x_fp8 = ops.quantize_fp8(x[:, : k + e].contiguous(), scale)[0]

        def gemm(x_fp8=x_fp8, weight=weight):
            return ops.fp8_matmul(x_fp8, scale, weight, w_scale, None, torch.bfloat16)

        row["gemm_us"][e] = 1000 * time_ms([gemm], 20, 5)
    xk = x[:, :k].contiguous()
    norm_w = torch.ones(k, dtype=x.dtype, device=x.device)
    channels = torch.arange(0, k, k // 16, device=x.device)[:16]
    q, s = ops.quantize_fp8(xk, scale)
    rest = remainder_fp8(xk, q, s, channels)
    pieces = {
        "norm_bf16": lambda: ops.rms_norm(xk, norm_w, 1e-5),
        "norm_quant_fused": lambda: ops.add_rms_norm_quant_fp8(xk, None, norm_w, 1e-5, scale),
        "quantize": lambda: ops.quantize_fp8(xk, scale),
        # the same kernels writing the 16 remainders themselves (outlier columns, fused)
        "norm_quant_fused_outlier": lambda: ops.add_rms_norm_quant_fp8(
            xk, None, norm_w, 1e-5, scale, channels
        ),
        "quantize_outlier": lambda: ops.quantize_fp8(xk, scale, channels),
        "remainder_torch": lambda: remainder_fp8(xk, q, s, channels),
        "cat": lambda: torch.cat([q.view(torch.uint8), rest.view(torch.uint8)], dim=1),
    }
    row["pieces_us"] = {p: 1000 * time_ms([f], 20, 5) for p, f in pieces.items()}
    return row


STRIDE_ROWS = (1000, 8192)
# (K + extra columns, the row stride's extra): the operands as views of wider rows, so the
# GEMM's K and its leading dimension's alignment are varied apart.
STRIDE_CASES = ((0, 0), (16, 16), (16, 128), (32, 32), (32, 128), (128, 128))
# --operands: K + 16 with one operand's rows padded to K + 128 and the other's not.
OPERAND_CASES = ((16, 128, 16), (16, 16, 128))  # (extra, the input's pad, the weight's pad)


def _strides_row(time_ms, name: str, n: int, k: int, rows: int, gen, device: str) -> dict:
    """The rowwise GEMM (ops.fp8_matmul at these rows) over K + e columns whose rows are
    K + pad apart (a view of a wider buffer, as a kernel writing into padded rows would give)."""
    from kiln.kernels import triton as ops

    scale = torch.tensor(SCALE, device=device)
    w_scale = torch.full((n,), 1e-2, device=device)
    row: dict = {"shape": name, "n": n, "k": k, "rows": rows, "us": {}}
    cases = [(e, pad, pad) for e, pad in STRIDE_CASES] + list(OPERAND_CASES)
    for e, x_pad, w_pad in cases:
        wide_w = (torch.randn(n, k + w_pad, generator=gen) * 0.02).to(device)
        wide_x = (torch.randn(rows, k + x_pad, generator=gen) * 3).to(device)
        weight = wide_w.to(torch.float8_e4m3fn)[:, : k + e]
        x_fp8 = wide_x.to(torch.float8_e4m3fn)[:, : k + e]

        def gemm(x_fp8=x_fp8, weight=weight):
            return ops.fp8_matmul(x_fp8, scale, weight, w_scale, None, torch.bfloat16)

        label = f"k+{e} ld k+{x_pad}" if x_pad == w_pad else f"k+{e} x ld k+{x_pad} w ld k+{w_pad}"
        row["us"][label] = 1000 * time_ms([gemm], 20, 5)
    return row


def _untimed(calls: list, reps: int, replays: int) -> float:
    """--dry-run's stand-in for tile_sweep.graph_time_ms: runs each call once."""
    for fn in calls:
        fn()
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="k_alignment.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, no timing")
    parser.add_argument("--strides", action="store_true", help="K and the row stride apart")
    args = parser.parse_args()
    if args.strides:
        from tile_sweep import graph_time_ms

        gen = torch.Generator().manual_seed(0)
        found = []
        for name, (n, k) in SHAPES.items():
            for rows in STRIDE_ROWS:
                found.append(_strides_row(graph_time_ms, name, n, k, rows, gen, "cuda"))
                print(json.dumps(found[-1]), flush=True)
        with open(args.out, "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "results": found}, f, indent=1)
        return
    if args.dry_run:
        ops, time_ms = reference, _untimed
        device, shapes, rows_list = "cpu", {"tiny": (32, 64)}, (1, 4)
    else:
        from tile_sweep import graph_time_ms as time_ms

        from kiln.kernels import triton as ops

        device, shapes, rows_list = "cuda", SHAPES, ROWS
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor(SCALE, device=device)
    results = []
    for name, (n, k) in shapes.items():
        weights = {
            e: (torch.randn(n, k + e, generator=gen) * 0.02).to(device).to(torch.float8_e4m3fn)
            for e in EXTRA
        }
        for rows in rows_list:
            x = torch.randn(rows, k + max(EXTRA), generator=gen).to(device, torch.bfloat16)
            row = _row(ops, time_ms, name, weights, x, scale)
            results.append(row)
            print(json.dumps(row), flush=True)
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)"
    with open(args.out, "w") as f:
        json.dump({"gpu": gpu, "scale": SCALE, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
