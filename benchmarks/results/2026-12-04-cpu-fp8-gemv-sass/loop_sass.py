"""The weight stream's loop in sm_90 SASS: the engine's one-row float8 projection against the
CUDA-core candidate (fp8_gemv_kernels.py, this folder), compiled on the CPU with Triton 3.6 (the
H200's version; see ../../quant_sass_count.py for the setup).

Per kernel: the loop that issues the weight loads (a backward branch to a label), its
instructions (NOPs apart), the weight bytes a thread loads in one trip (LDG / LDGSTS widths),
instructions per weight byte, barriers and shared-memory accesses a trip, registers.

    PYTHONPATH=. /tmp/t36/bin/python benchmarks/results/2026-12-04-cpu-fp8-gemv-sass/loop_sass.py
"""

from __future__ import annotations

import collections
import json
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this folder, benchmarks/

import triton  # noqa: E402
from fp8_gemv_kernels import _fp8_gemv_kernel  # noqa: E402
from quant_sass_count import _compile, _registers, _sass, _small_batch  # noqa: E402

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE  # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)((?:\.[\w]+)*)(.*)")
_LABEL = re.compile(r"^\.(L_x_\d+):")
_WIDTH = {"128": 16, "64": 8, "U8": 1, "U16": 2}


def _loops(sass: str) -> list[dict]:
    """Each backward branch's body: [label, branch] in instruction order."""
    insts, labels = [], {}
    for line in sass.splitlines():
        m = _LABEL.match(line.strip())
        if m:
            labels[m.group(1)] = len(insts)
            continue
        m = _LINE.search(line)
        if m:
            insts.append((m.group(2), m.group(3), m.group(4)))
    loops = []
    for i, (op, _, rest) in enumerate(insts):
        target = re.search(r"\(\.(L_x_\d+)\)", rest) if op == "BRA" else None
        if target and labels.get(target.group(1), i + 1) <= i:
            loops.append(insts[labels[target.group(1)] : i + 1])
    return [_count(body) for body in loops]


def _count(body: list) -> dict:
    ops = collections.Counter(op + suffix for op, suffix, _ in body if op != "NOP")
    loaded = 0
    for op, suffix, _ in body:
        if op in ("LDG", "LDGSTS"):
            widths = [_WIDTH[s] for s in suffix.strip(".").split(".") if s in _WIDTH]
            loaded += widths[0] if widths else 4
    return {
        "instructions": sum(ops.values()),
        "global_load_bytes_a_thread": loaded,
        "barriers": sum(v for k, v in ops.items() if k.startswith("BAR")),
        "shared_accesses": sum(v for k, v in ops.items() if k.startswith(("LDS", "STS", "LDSM"))),
        "mma": sum(v for k, v in ops.items() if "MMA" in k),
        "ffma": sum(v for k, v in ops.items() if k.startswith("FFMA")),
        "conversions": sum(v for k, v in ops.items() if k.startswith(("F2FP", "HADD2.F32"))),
        "prmt": ops.get("PRMT", 0),
    }


def _candidate(k: int, stage_x: bool, prefetch: bool, gated: bool = False, block_n: int = 16):
    types = {
        "x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "in_scale_ptr": "*fp32",
        "out_ptr": "*bf16", "q_ptr": "*fp8e4nv", "part_ptr": "*fp32", "counter_ptr": "*i32",
        "N": "i32", "__aligned__": ("N",),
    }  # fmt: skip
    constexprs = {
        "K": k, "K_PER_SPLIT": triton.cdiv(triton.cdiv(k, 4), 512) * 512, "STATIC": True,
        "GATED": gated, "BLOCK_N": block_n, "BLOCK_K": 512, "STATS_BLOCK": 2048, "SPLIT_K": 4,
        "PREFETCH": prefetch, "STAGE_X": stage_x, "INTERPRETED": False,
        "FP8_MAX": FP8_E4M3_MAX, "MIN_SCALE": FP8_MIN_SCALE,
    }  # fmt: skip
    return _fp8_gemv_kernel, types, constexprs, 4


CASES = {
    # the engine's measured o_proj tiles (64 x 256, 4 warps, 3 stages, split 4), static scale
    "engine small_batch_linear, static, 64 x 256 tiles": lambda: _small_batch(2, 0)[:4],
    "candidate, 16 x 512, x quantized in the loop": lambda: _candidate(4096, False, False),
    "candidate, the same, next tile prefetched": lambda: _candidate(4096, False, True),
    "candidate, x staged as float8 first": lambda: _candidate(4096, True, False),
    "candidate, gated (gate_up), x in the loop": lambda: _candidate(4096, False, False, True),
}


def main() -> None:
    results = {"triton": triton.__version__, "target": "sm_90", "kernels": {}}
    for name, make in CASES.items():
        fn, types, constexprs, warps = make()
        compiled = _compile(fn, types, constexprs, warps)
        loops = _loops(_sass(compiled.asm["cubin"]))
        stream = max(loops, key=lambda loop: loop["global_load_bytes_a_thread"])
        per_byte = stream["instructions"] / stream["global_load_bytes_a_thread"]
        entry = {**stream, "instructions_a_loaded_byte": round(per_byte, 2)}
        entry["registers"] = _registers(compiled.asm["cubin"])
        results["kernels"][name] = entry
        print(f"{name}: {json.dumps(entry)}", flush=True)
    (HERE / "loop_counts.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
