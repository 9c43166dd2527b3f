"""The one-kernel FP8 MLP block at batch 1 (kernels/triton/mlp_one_row.py) against the engine's
two kernels, at Llama-3.1-8B's shapes.

    PYTHONPATH=benchmarks:. python3 benchmarks/mlp_one_row_sweep.py --out mlp_one_row.json
    PYTHONPATH=benchmarks:. python3 benchmarks/mlp_one_row_sweep.py --dry-run   # the CPU

Times, each as back-to-back calls inside one CUDA graph (as the decode step runs them), two
layers' weights alternating (176 MB of float8 a layer: more than L2 holds either way):
- `engine`: add_rms_norm_linear_silu_mul_fp8 (norm + gate_up + SiLU-mul, one kernel) then
  fp8_linear (down, quantizing its input itself), the measured tiles; `gate_up` and `down`
  alone;
- `fused`: mlp_one_row.launch at every tile configuration of the grid below (ones that do not
  compile, e.g. out of shared memory, are listed as such), each checked against the fp32
  reference (reference.add_rms_norm_mlp_fp8) before it is timed.
Expected (benchmarks/mlp_one_row_expected.md): the engine ~53 us a block, the fused kernel's
best 44-48 us.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

if "--dry-run" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

from kiln.kernels import reference
from kiln.kernels.triton import mlp_one_row
from kiln.kernels.triton.mlp_one_row import MlpTiles

HIDDEN, INTERMEDIATE = 4096, 14336
SCALE = 4.0 / 448.0
EPS = 1e-5
GRID = {
    "block_c": (64, 128, 32),  # the likeliest first: a run cut short keeps them
    "block_k": (128, 256),
    "block_h": (64, 128),
    "num_warps": (4, 8),
    "num_stages": (3, 4),
}


def _layer(hidden: int, inter: int, seed: int, device: str) -> dict:
    gen = torch.Generator().manual_seed(seed)
    gate_up, gate_up_scale = reference.quantize_fp8(
        torch.randn(2 * inter, hidden, generator=gen) * 0.02, None
    )
    down, down_scale = reference.quantize_fp8(
        torch.randn(hidden, inter, generator=gen) * 0.02, None
    )
    return {
        "gate_up_weight": gate_up.to(device),
        "gate_up_scale": gate_up_scale.view(-1).to(device),
        "gate_up_input_scale": torch.tensor(SCALE, device=device),
        "down_weight": down.to(device),
        "down_scale": down_scale.view(-1).to(device),
        "down_input_scale": torch.tensor(SCALE, device=device),
    }


def _engine(x, residual, norm, w) -> tuple[torch.Tensor, ...]:
    return mlp_one_row.two_kernels(x, residual, norm, EPS, *w.values())


def _fused(x, residual, norm, w, tiles: MlpTiles | None) -> tuple[torch.Tensor, ...]:
    return mlp_one_row.launch(x, residual, norm, EPS, *w.values(), tiles=tiles)


def _reference(x, residual, norm, w) -> torch.Tensor:
    out, _ = reference.add_rms_norm_mlp_fp8(
        x.float(), residual.float(), norm.float(), EPS, *w.values()
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="mlp_one_row.json")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, the interpreter")
    args = parser.parse_args()
    if args.dry_run:
        hidden, inter, dtype, device = 64, 96, torch.float32, "cpu"
        grid = [mlp_one_row.INTERPRETER_TILES, mlp_one_row.INTERPRETER_TILES._replace(block_c=32)]
    else:
        from tile_sweep import graph_time_ms

        from kiln.kernels import triton as ops

        hidden, inter, dtype, device = HIDDEN, INTERMEDIATE, torch.bfloat16, "cuda"
        grid = [MlpTiles(*values, stats_block=1024) for values in itertools.product(*GRID.values())]
    layers = [_layer(hidden, inter, seed, device) for seed in (1, 2)]
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, hidden, generator=gen).to(device, dtype)
    residual = torch.randn(1, hidden, generator=gen).to(device, dtype)
    norm = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(device, dtype)
    want = _reference(x, residual, norm, layers[0])
    block_bytes = sum(t.numel() for t in layers[0].values() if t.element_size() == 1)

    def timed(make) -> float:
        calls = [lambda w=w: make(w) for w in layers]
        return 1000 * graph_time_ms(calls, reps=10, replays=5) if device == "cuda" else 0.0

    def error(out: torch.Tensor) -> float:
        return float((out.float().cpu() - want.cpu()).abs().max() / want.abs().max())

    rows = []
    engine_out, _ = _engine(x, residual, norm, layers[0])
    rows.append({"variant": "engine", "rel_err": error(engine_out)})
    if device == "cuda":
        rows[-1]["us"] = timed(lambda w: _engine(x, residual, norm, w))
        rows.append({"variant": "gate_up alone", "us": timed(
            lambda w: ops.add_rms_norm_linear_silu_mul_fp8(
                x, residual, norm, EPS, w["gate_up_weight"], w["gate_up_scale"],
                w["gate_up_input_scale"], w["down_input_scale"]))})  # fmt: skip
        act = torch.randn(1, inter, generator=gen).to(device, dtype)
        rows.append({"variant": "down alone", "us": timed(
            lambda w: ops.fp8_linear(act, w["down_weight"], w["down_scale"],
                                     w["down_input_scale"]))})  # fmt: skip
    for tiles in grid:
        row = {"variant": "fused", "tiles": tiles._asdict()}
        try:
            out, _ = _fused(x, residual, norm, layers[0], tiles)
        except Exception as exc:  # a configuration that does not compile
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        row["rel_err"] = error(out)
        if device == "cuda":
            row["us"] = timed(lambda w, tiles=tiles: _fused(x, residual, norm, w, tiles))
        rows.append(row)
        print(json.dumps(row), flush=True)
        _write(args.out, hidden, inter, block_bytes, rows)
    summary = _write(args.out, hidden, inter, block_bytes, rows)
    print("summary", json.dumps(summary), flush=True)
    assert summary["agree"], "a variant disagrees with the reference"


def _write(path: str, hidden: int, inter: int, block_bytes: int, rows: list[dict]) -> dict:
    """The JSON so far (after every configuration: a run stopped by its time limit keeps what
    it measured), with each timed row's weight bytes a second and the best fused row."""
    for row in rows:
        if row.get("us") and ("tiles" in row or row["variant"] == "engine"):
            row["tb_s"] = block_bytes / row["us"] / 1e6  # the block's weight bytes a second
    fused = [r for r in rows if r.get("us") and "tiles" in r and r["rel_err"] < 2e-2]
    best = min(fused, key=lambda r: r["us"]) if fused else None
    summary = {"engine_us": rows[0].get("us"), "best_fused": best, "block_bytes": block_bytes}
    summary["agree"] = all(r.get("rel_err", 0) < 2e-2 for r in rows)  # with the reference
    with open(path, "w") as f:
        json.dump({"shape": [hidden, inter], "summary": summary, "results": rows}, f, indent=1)
    return summary


if __name__ == "__main__":
    main()
