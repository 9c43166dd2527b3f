"""Static sm_90 SASS instruction counts of kiln's float8 activation-quantization kernels, compiled
on the CPU (no GPU needed): Triton's ASTSource -> cubin for GPUTarget("cuda", 90, 64), then the
bundled nvdisasm. The counts are of the code as compiled (a loop body counts once), so they compare
two versions of a kernel at the same launch shape, not kernels with each other.

The shapes are Llama-3.1-8B's at the launches the engine makes on the H200: SiLU-mul + quantize
over d = 14336 (one pass, 16 warps, 32 values a thread), add + RMSNorm + quantize over 4096 (8
warps, 16 values a thread), quantize_fp8 over K = 4096 (BLOCK 2048, 4 warps), and the one-row
float8 small-batch linear (o_proj-like 4096 x 4096, its measured tiles) with its activation
quantized inside.

Run it with Triton 3.6 (the H200's version), e.g.
  python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install -q triton==3.6.0 torch==2.13.0 pyelftools
  PYTHONPATH=. /tmp/t36/bin/python benchmarks/quant_sass_count.py --out counts.json
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE

# By module path: kiln.kernels.triton re-exports functions under some of these names.
fp8_gemm = importlib.import_module("kiln.kernels.triton.fp8_gemm")
rms_norm = importlib.import_module("kiln.kernels.triton.rms_norm")
silu_mul = importlib.import_module("kiln.kernels.triton.silu_mul")
small_batch_linear = importlib.import_module("kiln.kernels.triton.small_batch_linear")

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_TARGET = GPUTarget("cuda", 90, 64)
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]+)?")


def _compile(fn, types: dict[str, str], constexprs: dict, num_warps: int, num_stages: int = 3):
    """fn compiled for sm_90 with these argument types: pointers and integer arguments named in
    `aligned` are marked divisible by 16, as the launcher marks 16-byte-aligned tensors and
    multiples of 16 (every stride and width here)."""
    signature = {}
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types[name]
        if types[name].startswith("*") or name in types.get("__aligned__", ()):
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=_TARGET, options=options)


def _sass(cubin: bytes) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        nvdisasm = os.path.join(_BIN, "nvdisasm")
        return subprocess.run(
            [nvdisasm, "-c", f.name], check=True, capture_output=True, text=True
        ).stdout


def _registers(cubin: bytes) -> int | None:
    """The kernel's registers a thread, from cuobjdump's resource usage (no driver needed)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [os.path.join(_BIN, "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True
        ).stdout
    m = re.search(r"REG:(\d+)", out)
    return int(m.group(1)) if m else None


def count(sass: str) -> dict:
    """Instructions of the SASS listing, NOPs apart; the opcodes that matter here by name."""
    ops = collections.Counter()
    for line in sass.splitlines():
        m = _INSTRUCTION.search(line)
        if m:
            ops[m.group(1) + (m.group(2) or "")] += 1
    total = sum(ops.values())
    nops = ops.get("NOP", 0)
    mufu = {k: v for k, v in ops.items() if k.startswith("MUFU")}
    return {
        "instructions": total - nops,
        "nops": nops,
        "mufu": mufu,
        "calls": sum(v for k, v in ops.items() if k.startswith("CALL")),
        "ffma": sum(v for k, v in ops.items() if k.startswith("FFMA")),
        "fmul": sum(v for k, v in ops.items() if k.startswith("FMUL")),
        "f2fp": sum(v for k, v in ops.items() if k.startswith("F2FP")),
    }


# The quantizing kernels' outlier-column arguments (kiln.quantization.outlier_columns), unused
# here: each case's REMAINDERS is 0.
_NO_CHANNELS = {"channels_ptr": "*i64", "n_channels": "i32"}


def _silu(dynamic: bool) -> tuple:
    d = 14336
    one_pass, block, warps = silu_mul._quant_tiles(d, 512)
    types = {
        "x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32",
        "stride_x": "i32", "stride_out": "i32", "d": "i32", **_NO_CHANNELS,
        "__aligned__": ("stride_x", "stride_out", "d"),
    }  # fmt: skip
    constexprs = {
        "DYNAMIC": dynamic, "ONE_PASS": one_pass, "BLOCK": block, "FP8_MAX": FP8_E4M3_MAX,
        "MIN_SCALE": FP8_MIN_SCALE, "INTERPRETED": False, "REMAINDERS": 0,
    }  # fmt: skip
    return silu_mul._silu_and_mul_quant_fp8_kernel, types, constexprs, warps, block // (32 * warps)


def _rms(dynamic: bool, residual: bool) -> tuple:
    import triton.language as tl

    hidden = 4096
    block = triton.next_power_of_2(hidden)
    warps = min(16, max(1, block // 512))
    types = {
        "x_ptr": "*bf16", "residual_ptr": "*bf16", "weight_ptr": "*bf16", "out_ptr": "*fp8e4nv",
        "sum_ptr": "*bf16", "stride_x": "i32", "stride_residual": "i32", "stride_out": "i32",
        "stride_sum": "i32", "hidden": "i32", "eps": "fp32", "scale_ptr": "*fp32", **_NO_CHANNELS,
        "__aligned__": ("stride_x", "stride_residual", "stride_out", "stride_sum", "hidden"),
    }  # fmt: skip
    constexprs = {
        "ADD_RESIDUAL": residual, "BLOCK": block, "QUANT": True, "DYNAMIC": dynamic,
        "OUT_DTYPE": tl.bfloat16, "INTERPRETED": False, "FP8_MAX": FP8_E4M3_MAX,
        "MIN_SCALE": FP8_MIN_SCALE, "REMAINDERS": 0,
    }  # fmt: skip
    return rms_norm._rms_norm_kernel, types, constexprs, warps, block // (32 * warps)


def _quantize(dynamic: bool) -> tuple:
    k = 4096
    block = min(triton.next_power_of_2(k), 2048)
    types = {
        "x_ptr": "*bf16", "out_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "stride_x": "i32",
        "stride_out": "i32", "K": "i32", **_NO_CHANNELS,
        "__aligned__": ("stride_x", "stride_out", "K"),
    }  # fmt: skip
    constexprs = {
        "DYNAMIC": dynamic, "FP8_MAX": FP8_E4M3_MAX, "MIN_SCALE": FP8_MIN_SCALE, "BLOCK": block,
        "INTERPRETED": False, "REMAINDERS": 0,
    }  # fmt: skip
    return fp8_gemm._quantize_fp8_kernel, types, constexprs, 4, block // (32 * 4)


def _small_batch(quant: int, prologue: int) -> tuple:
    # ("linear", 4096, 4096, 1, True) and its norm form: the measured one-row tiles.
    types = {
        "x_ptr": "*bf16", "residual_ptr": "*bf16", "norm_weight_ptr": "*bf16",
        "w_ptr": "*fp8e4nv", "bias_ptr": "*bf16", "out_ptr": "*bf16", "sum_ptr": "*bf16",
        "w_scale_ptr": "*fp32", "in_scale_ptr": "*fp32", "part_ptr": "*fp32",
        "counter_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_per_split": "i32",
        "stride_xm": "i32", "stride_om": "i32", "stride_wn": "i32", "eps": "fp32",
        "__aligned__": ("N", "K", "k_per_split", "stride_xm", "stride_om", "stride_wn"),
    }  # fmt: skip
    constexprs = {
        "PROLOGUE": prologue, "HAS_BIAS": False, "GATED": False, "BLOCK_M": 16, "BLOCK_N": 64,
        "BLOCK_K": 256, "STATS_BLOCK": 1024, "SPLIT_K": 4, "DOT_PRECISION": "ieee",
        "QUANT": quant, "FP8_DOT": True, "INTERPRETED": False, "SWAP_AB": False,
    }  # fmt: skip
    return small_batch_linear._small_batch_linear_kernel, types, constexprs, 4, None


CASES = {
    "silu_mul_quant dynamic d=14336": lambda: _silu(True),
    "silu_mul_quant static d=14336": lambda: _silu(False),
    "add_rms_norm_quant dynamic 4096": lambda: _rms(True, True),
    "add_rms_norm_quant static 4096": lambda: _rms(False, True),
    "rms_norm_quant dynamic 4096": lambda: _rms(True, False),
    "quantize_fp8 dynamic K=4096": lambda: _quantize(True),
    "quantize_fp8 static K=4096": lambda: _quantize(False),
    "small_batch fp8 linear dynamic 1 row 4096x4096": lambda: _small_batch(1, 0),
    "small_batch fp8 linear static 1 row 4096x4096": lambda: _small_batch(2, 0),
    "small_batch fp8 add_norm_linear dynamic 1 row 4096x4096": lambda: _small_batch(1, 2),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    parser.add_argument("--sass-dir", help="write each kernel's SASS listing here")
    parser.add_argument("--only", help="run the cases whose name contains this")
    args = parser.parse_args()
    results = {"triton": triton.__version__, "target": "sm_90", "kernels": {}}
    for name, make in CASES.items():
        if args.only and args.only not in name:
            continue
        fn, types, constexprs, warps, per_thread = make()
        compiled = _compile(fn, types, constexprs, warps)
        sass = _sass(compiled.asm["cubin"])
        entry = count(sass)
        entry.update(num_warps=warps, values_per_thread=per_thread)
        entry["registers"] = _registers(compiled.asm["cubin"])
        results["kernels"][name] = entry
        print(f"{name:58s} {entry['instructions']:6d} instr  mufu {entry['mufu']}  "
              f"calls {entry['calls']}  regs {entry['registers']}", file=sys.stderr)  # fmt: skip
        if args.sass_dir:
            os.makedirs(args.sass_dir, exist_ok=True)
            with open(os.path.join(args.sass_dir, re.sub(r"\W+", "_", name) + ".sass"), "w") as f:
                f.write(sass)
    text = json.dumps(results, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
