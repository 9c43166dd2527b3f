"""The FP8 MLP block of one row: its two launches (gate_up with the norm and SiLU-mul, then down)
against the one launch of kernels.triton.one_row_mlp, Llama-3.1-8B's shapes, static and dynamic
activation scales, timed as back-to-back calls inside one CUDA graph (as the decode step runs
them) with the weights cycled through copies larger than L2 (read from HBM, as at decode).

    PYTHONPATH=benchmarks:. python3 benchmarks/one_row_mlp_bench.py --out one_row_mlp.json
    PYTHONPATH=benchmarks:. python3 benchmarks/one_row_mlp_bench.py --tiny   # the CPU

Each side's outputs are compared bit for bit first (the one launch runs the same programs).
Each side is timed twice, in both orders.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

HIDDEN, INTERMEDIATE = 4096, 14336
L2_BYTES = 60 * 2**20


def _inputs(hidden: int, intermediate: int, dev: str, static: bool) -> dict:
    from kiln.kernels import reference

    g = torch.Generator(device="cpu").manual_seed(0)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float16  # interpreter: fp16 dots
    block_bytes = 3 * hidden * intermediate
    copies = max(2, math.ceil(3 * L2_BYTES / block_bytes)) if dev == "cuda" else 2
    weights = []
    for _ in range(copies):
        gate_up = 0.05 * torch.randn(2 * intermediate, hidden, generator=g)
        down = 0.05 * torch.randn(hidden, intermediate, generator=g)
        (gu, gu_s), (d, d_s) = (
            reference.quantize_fp8(gate_up, None),
            reference.quantize_fp8(down, None),
        )
        weights.append([t.to(dev) for t in (gu, gu_s.view(-1), d, d_s.view(-1))])
    return {
        "x": torch.randn(1, hidden, generator=g).to(dtype).to(dev),
        "residual": torch.randn(1, hidden, generator=g).to(dtype).to(dev),
        "norm_weight": (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(dev),
        "weights": weights,
        "gate_up_in": torch.tensor(4.0 / 448, device=dev) if static else None,
        "down_in": torch.tensor(0.5 / 448, device=dev) if static else None,
    }


# (one_row_mlp.ENABLED, DOWN_PREFETCH_STEPS): two launches; one with roles by ticket; one as a
# cooperative grid of resident programs; each of the latter with down's first two weight steps
# asked of L2 before its wait.
SIDES = {
    "two": (0, 0),
    "ticket": (1, 0),
    "ticket_prefetch2": (1, 2),
    "coop": (2, 0),
    "coop_prefetch2": (2, 2),
}


def _calls(ops, one_row_mlp, inputs: dict, side: str) -> list:
    """The side's calls (SIDES), one per weight copy."""

    def call(w):
        one_row_mlp.ENABLED, one_row_mlp.DOWN_PREFETCH_STEPS = SIDES[side]
        gu, gu_s, d, d_s = w
        return ops.add_rms_norm_mlp_fp8(
            inputs["x"], inputs["residual"], inputs["norm_weight"], 1e-5, gu, gu_s,
            inputs["gate_up_in"], d, d_s, inputs["down_in"],
        )  # fmt: skip

    return [lambda w=w: call(w) for w in inputs["weights"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: TRITON_INTERPRET=1")
    args = parser.parse_args()
    if args.tiny:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from kiln.kernels import triton as ops
    from kiln.kernels.triton import one_row_mlp

    dev = "cpu" if args.tiny else "cuda"
    hidden, intermediate = (64, 96) if args.tiny else (HIDDEN, INTERMEDIATE)
    result = {"gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "blocks": {}}
    for static in (True, False):
        inputs = _inputs(hidden, intermediate, dev, static)
        sides = {
            side: _calls(ops, one_row_mlp, inputs, side)
            for side in SIDES
            if dev == "cuda" or not side.startswith("coop")  # the interpreter: no cooperative grid
        }
        equal = all(
            all(torch.equal(a, b) for a, b in zip(two(), other()))
            for side in sides
            if side != "two"
            for two, other in zip(sides["two"], sides[side])
        )
        times = {side: [] for side in sides}
        order = [side for side in SIDES if dev == "cuda" or not side.startswith("coop")]
        for side in order + order[::-1]:
            if dev == "cpu":
                t0 = time.perf_counter()
                sides[side][0]()
                times[side].append(1e6 * (time.perf_counter() - t0))
                continue
            from tile_sweep import graph_time_ms  # benchmarks/, the script's own folder

            reps = max(1, args.reps // len(sides[side]))
            times[side].append(1000 * graph_time_ms(sides[side], reps=reps, replays=5))
        name = "static" if static else "dynamic"
        result["blocks"][name] = {"equal_bits": equal, "us": times}
        print(f"{name:8s} us {times}, equal bits {equal}", flush=True)
    one_row_mlp.ENABLED, one_row_mlp.DOWN_PREFETCH_STEPS = False, 0
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
