"""The float8 small-batch kernels against bf16's and the FP8 GEMM path at Llama-3.1-8B's decode
shapes (GPU), and a sweep of their launch shapes: split-K factors 1/2/4/8, tiles and pipeline
depth, then the input row's first-pass step for the best few. One run picks the entries of
small_batch_tiles.MEASURED_TILES (printed at the end, and in the JSON under "suggested").

    PYTHONPATH=. python3 benchmarks/fp8_small_batch_sweep.py --out fp8_small_batch.json

Per projection, the op a decode layer calls: "bf16" on bf16 weights, "fp8" the same op on
float8 weights with dynamic activations at today's launch shape, "fp8_gemm" what FP8 ran before
at these rows (the norm kernel, quantize_fp8, _scaled_mm, the scale epilogue; SiLU-mul's kernel
for gate_up, the rotary kernel for qkv). One row runs the fused kernels (qkv: norm, projection,
rotary and KV write in one); 8 rows the plain kernel after the norm kernel and quantize_fp8.
Timed as back-to-back calls in one CUDA graph over enough weight copies that each call reads its
weight from HBM. Every swept configuration's output is checked against the FP8 GEMM path's; a
configuration off by more than --max-err (relative to the output's largest value) is reported
and never suggested. The sweep stops at --budget-s (compiles dominate: ~0.5 s a configuration).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch
import triton
from tile_sweep import graph_time_ms, rotary_inputs, sweep  # benchmarks/, the script's own folder

from kiln.kernels import reference
from kiln.kernels.triton import fp8_gemm, qkv_rotary, small_batch_tiles
from kiln.kernels.triton import small_batch_linear as sbl
from kiln.kernels.triton.rms_norm import fused_add_rms_norm
from kiln.kernels.triton.rotary import rotary_embedding_write_kv
from kiln.kernels.triton.silu_mul import silu_and_mul
from kiln.kernels.triton.small_batch_tiles import Tiles

HIDDEN, INTERMEDIATE, HEAD_DIM, NUM_KV_HEADS, NUM_LAYERS = 4096, 14336, 128, 8, 32
SHAPES = {  # name: (weight rows, K, the kernel at one row, at 2-8 rows)
    "qkv": (6144, HIDDEN, "qkv_rotary", "linear"),
    "o_proj": (HIDDEN, HIDDEN, "linear", "linear"),
    "gate_up": (2 * INTERMEDIATE, HIDDEN, "norm_linear_silu_mul", "linear_silu_mul"),
    "down": (HIDDEN, INTERMEDIATE, "linear", "linear"),
}
LAYER_SHAPES = tuple(SHAPES)  # a decoder layer's projections (the default, the layer summary)
# The LM head as --lm-head-quantization fp8 runs it: fp8_linear, the plain kernel (its bf16
# column is the small-batch kernel, not the cuBLAS GEMV compute_logits runs in bf16).
SHAPES["lm_head"] = (128256, HIDDEN, "linear", "linear")
COPY_BANDWIDTH = 4.25e12  # bytes/s, the H200's measured device-to-device copy (FACTS.md)
L2_BYTES = 50 * 2**20
SMEM_BYTES = 227 * 1024  # an H100/H200 program's most shared memory


class Op:
    """The call a decode layer makes for one projection, on given weights."""

    def __init__(self, name: str, rows: int, dev: str) -> None:
        k = SHAPES[name][1]
        self.name = name
        self.x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        self.residual = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
        self.norm_weight = 1 + 0.1 * torch.randn(k, device=dev, dtype=torch.bfloat16)
        self.cos_sin, self.positions, self.slots, self.caches = rotary_inputs(
            rows, HEAD_DIM, NUM_KV_HEADS, dev, torch.bfloat16
        )

    def fused(self, w: torch.Tensor, ws: torch.Tensor | None = None) -> torch.Tensor:
        """The small-batch op (ws: float8 weight scales, dynamic activations)."""
        x, res, nw = self.x, self.residual, self.norm_weight
        if self.name == "qkv":
            return qkv_rotary.add_rms_norm_qkv_rotary_write_kv(
                x, res, nw, 1e-5, w, None, self.positions, self.cos_sin, *self.caches,
                self.slots, ws, None,
            )[0]  # fmt: skip
        if self.name == "gate_up":
            return sbl.add_rms_norm_linear_silu_mul(x, res, nw, 1e-5, w, ws, None)[0]
        return sbl.linear(x, w) if ws is None else sbl.fp8_linear(x, w, ws, None)

    def gemm_path(self, w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
        """What FP8 ran before the small-batch kernels took float8 weights."""
        if self.name in ("o_proj", "down", "lm_head"):
            return fp8_gemm.fp8_linear(self.x, w, ws, None)
        h = fused_add_rms_norm(self.x, self.residual, self.norm_weight, 1e-5)[0]
        out = fp8_gemm.fp8_linear(h, w, ws, None)
        if self.name == "gate_up":
            return silu_and_mul(out)
        q, k, v = reference.split_qkv_heads(out, HEAD_DIM, NUM_KV_HEADS)
        return rotary_embedding_write_kv(
            self.positions, q, k, v, self.cos_sin, *self.caches, self.slots
        )


def time_us(fn, weights) -> float:
    calls = [functools.partial(fn, *w) if isinstance(w, tuple) else functools.partial(fn, w)
             for w in weights]  # fmt: skip
    return graph_time_ms(calls, reps=4, replays=5) * 1000


def candidate_tiles(
    kernel: str, n: int, k: int, rows: int, sms: int, wide: bool = False,
    splits: tuple[int, ...] = (1, 2, 4, 8),
) -> list[Tiles]:  # fmt: skip
    """The launch shapes worth timing, split factors (and, --wide, warp counts) interleaved so a
    budget cut leaves each some: per split at least two K steps, 1/2 to 16 programs per SM,
    tiles that fit in shared memory, gated and qkv programs with at least 16 rows of each half.
    Fewer at 8 rows, whose plain kernel has no first pass over the row. --wide adds 8 warps,
    pipelines of 2-6 stages, 128-row and 64-wide tiles: what the 4-warp, 3-4 stage sweep never
    tried (gate_up at one row stayed at 35.8 us against 27.6 at the copy bandwidth)."""
    paired = kernel in ("linear_silu_mul", "norm_linear_silu_mul", "qkv_rotary")
    block_ns = (32, 64) if paired or rows > 1 else (16, 32, 64)
    block_ks = (128, 256, 512, 1024) if rows == 1 else (256, 512, 1024)
    stages = (3, 4) if rows == 1 else (4,)
    warps: tuple[int, ...] = (4,)
    if wide:
        block_ns = (*block_ns, 128)
        block_ks = (64, *block_ks) if rows == 1 else (128, *block_ks)
        stages, warps = (2, 3, 4, 5, 6), (4, 8)
    groups: dict[tuple[int, int], list[Tiles]] = {}
    for split, num_warps, block_n, block_k, num_stages in itertools.product(
        splits, warps, block_ns, block_ks, stages
    ):
        programs = triton.cdiv(n, block_n) * split
        if k // split < 2 * block_k or not sms / 2 <= programs <= 16 * sms:
            continue
        if block_n * block_k * num_stages > SMEM_BYTES:
            continue
        tiles = Tiles(block_n, block_k, num_warps, num_stages, split)
        groups.setdefault((split, num_warps), []).append(tiles)
    interleaved = itertools.zip_longest(*groups.values())
    return [t for group in interleaved for t in group if t is not None]


def sweep_shape(op: Op, kernel: str, fp8: list, want: torch.Tensor, budget_s: float,
                max_err: float, rows: int, wide: bool = False,
                splits: tuple[int, ...] = (1, 2, 4, 8)) -> tuple[list[dict], int, int]:  # fmt: skip
    """Phase 1: the candidates, the first pass over the row in BLOCK_K steps; phase 2 (one row):
    the best three with wider first-pass steps. Returns (the timed configurations, how many
    candidates, how many were left for the budget)."""
    n, k = fp8[0][0].shape
    deadline = time.perf_counter() + budget_s
    run = functools.partial(op.fused, *fp8[0])

    def timed_ms(run: object) -> float:  # every weight copy in turn, not only run's
        return time_us(op.fused, fp8) / 1000

    scale = float(want.float().abs().max())
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    candidates = candidate_tiles(kernel, n, k, rows, sms, wide, splits)
    results, skipped = [], 0

    def run_phase(configs: list[Tiles]) -> None:
        nonlocal skipped
        for config in configs:
            if time.perf_counter() > deadline:
                skipped += 1
                continue
            label = f"{op.name} rows={rows}"
            results.extend(
                sweep(small_batch_tiles, [config], run, timed_ms, want, label, "tile_config")
            )

    run_phase(candidates)
    good = sorted((r for r in results if r["max_abs_err"] <= max_err * scale), key=by_ms)
    if rows == 1:
        widths = [w for w in (1024, 2048, 4096) if w <= triton.next_power_of_2(k)]
        run_phase(
            [Tiles(*r["config"][:5], w) for r in good[:3] for w in widths if w > r["config"][1]]
        )
    for r in results:
        r["us"] = r.pop("ms") * 1000
        r["ok"] = r["max_abs_err"] <= max_err * scale
    return results, len(candidates), skipped


def by_ms(result: dict) -> float:
    return result["ms"]


def by_us(result: dict) -> float:
    return result["us"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(LAYER_SHAPES))
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--budget-s", type=float, default=200.0, help="all the sweeps together")
    p.add_argument("--max-err", type=float, default=0.02, help="relative to the largest output")
    p.add_argument(
        "--fp8-step-ms",
        type=float,
        default=3.611,  # lat1k-fp8w's TPOT, benchmarks/results/2026-12-01-h200-fp8-small-batch/
        help="the batch-1 FP8 decode step the projected saving is taken from",
    )
    p.add_argument("--wide", action="store_true", help="8 warps, 2-6 stages, wider tiles too")
    p.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out", default="fp8_small_batch.json")
    args = p.parse_args()
    torch.manual_seed(0)
    dev = "cuda"
    results, suggested = [], {}
    start = time.perf_counter()
    # A sweep gets its share of what is left of the budget (one row's 4x 8 rows': batch-1 decode
    # is what they are for), so the time a quick sweep leaves goes to the next.
    sweeps = [(name, rows) for name in args.shapes for rows in args.rows]
    share = {rows: 4.0 if rows == 1 else 1.0 for rows in args.rows}
    for name in args.shapes:
        n, k, one_row_kernel, rows_kernel = SHAPES[name]
        copies = max(2, -(-3 * L2_BYTES // (n * k)))
        bf16 = [0.02 * torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(copies)]
        fp8 = []
        for w in bf16:
            w8, s = reference.quantize_fp8(w, None)
            fp8.append((w8, s.view(-1).contiguous()))
        for rows in args.rows:
            kernel = one_row_kernel if rows == 1 else rows_kernel
            op = Op(name, rows, dev)
            want = op.gemm_path(*fp8[0])
            default = small_batch_tiles.tile_config(kernel, n, k, op.x.device, 1, rows)
            row = {
                "shape": name, "n": n, "k": k, "rows": rows, "kernel": kernel,
                "fp8_bytes_floor_us": n * k / COPY_BANDWIDTH * 1e6,
                "bf16_us": time_us(op.fused, bf16),
                "fp8_us": time_us(op.fused, fp8),
                "fp8_gemm_us": time_us(op.gemm_path, fp8),
                "fp8_max_abs_err_vs_gemm": (op.fused(*fp8[0]) - want).abs().max().item(),
                "fp8_default_config": list(default),
            }  # fmt: skip
            results.append(row)
            print(
                f"{name:8s} rows={rows}: floor {row['fp8_bytes_floor_us']:6.1f} us, bf16 "
                f"{row['bf16_us']:6.1f}, fp8 {row['fp8_us']:6.1f} {list(default)}, "
                f"fp8 gemm path {row['fp8_gemm_us']:6.1f}, "
                f"err {row['fp8_max_abs_err_vs_gemm']:.3g}",
                flush=True,
            )
            sweeps.remove((name, rows))
            if args.no_sweep:
                continue
            left = args.budget_s - (time.perf_counter() - start)
            budget = left * share[rows] / (share[rows] + sum(share[r] for _, r in sweeps))
            tiles, num_candidates, skipped = sweep_shape(
                op, kernel, fp8, want, budget, args.max_err, rows, args.wide, tuple(args.splits)
            )
            good = sorted((t for t in tiles if t["ok"]), key=by_us)
            row["num_candidates"], row["skipped_for_budget"] = num_candidates, skipped
            row["wrong"] = [t for t in tiles if not t["ok"]]
            row["best_tiles"] = good[:8]
            row["best_by_split"] = {}
            for split in args.splits:
                of_split = [t for t in good if t["config"][4] == split]
                row["best_by_split"][split] = of_split[0] if of_split else None
            print(
                f"  {len(tiles)} timed of {num_candidates} (+ first-pass widths), {skipped} "
                f"left for the budget, {len(row['wrong'])} wrong; best by split: "
                + ", ".join(
                    f"{split}: {t['us']:.1f} {t['config']}"
                    for split, t in row["best_by_split"].items()
                    if t is not None
                ),
                flush=True,
            )
            # Suggested only when it beats today's shape by more than the timing's noise.
            if good and good[0]["us"] < 0.97 * row["fp8_us"]:
                key = (kernel, n, k, 1, rows == 1)
                suggested[key] = (Tiles(*good[0]["config"]), good[0]["us"], row["fp8_us"])
    summary = layer_summary(results, args.fp8_step_ms)
    print(f"took {time.perf_counter() - start:.0f} s")
    print("small_batch_tiles.MEASURED_TILES entries (the best shape; us, today's in brackets):")
    for key, (tiles, us, before) in suggested.items():
        print(f"    {key}: {tiles!r},  # {us:.1f} us ({before:.1f})")
    with open(args.out, "w") as f:
        json.dump(
            {
                "gpu": torch.cuda.get_device_name(),
                "results": results,
                "suggested": [[*key, list(t), us, was] for key, (t, us, was) in suggested.items()],
                "one_row_layer": summary,
            },
            f,
            indent=1,
        )


def layer_summary(results: list[dict], fp8_step_ms: float) -> dict | None:
    """One row's four projections per layer (bf16, FP8 today, FP8 at the best shapes), and what
    the saving would make of a batch-1 FP8 decode step of fp8_step_ms: a projection from kernel
    times, not a measurement of the step."""
    one_row = {r["shape"]: r for r in results if r["rows"] == 1}
    one_row = {name: r for name, r in one_row.items() if name in LAYER_SHAPES}
    if set(one_row) != set(LAYER_SHAPES):
        return None
    bf16 = sum(r["bf16_us"] for r in one_row.values())
    today = sum(r["fp8_us"] for r in one_row.values())
    best = sum(
        min([r["fp8_us"], *(t["us"] for t in r.get("best_tiles", [])[:1])])
        for r in one_row.values()
    )
    floor = sum(r["fp8_bytes_floor_us"] for r in one_row.values())
    step_ms = fp8_step_ms - NUM_LAYERS * (today - best) / 1000
    print(
        f"per layer, one row: bf16 {bf16:.1f} us, fp8 today {today:.1f}, fp8 best {best:.1f}, "
        f"floor {floor:.1f}; a {fp8_step_ms:.3f} ms step would take {step_ms:.3f} ms "
        f"({1000 / step_ms:.0f} tok/s, projected)"
    )
    return {
        "per_layer_us": {"bf16": bf16, "fp8_today": today, "fp8_best": best, "fp8_floor": floor},
        "projected_step_ms": step_ms,
        "projected_tok_s": 1000 / step_ms,
    }


if __name__ == "__main__":
    main()
