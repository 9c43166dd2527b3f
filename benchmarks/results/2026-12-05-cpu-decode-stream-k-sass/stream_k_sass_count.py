"""Static sm_90 counts of the stream-K float8 decode kernel beside the packed one, compiled on the
CPU (Triton 3.6's ASTSource -> cubin, then its bundled nvdisasm and cuobjdump; no GPU): registers,
local memory (spills), shared memory, total instructions and the key loop's (the longest backward
branch holding HMMAs) by opcode class, at Llama-3.1-8B's constexprs (8 KV heads, GROUP 4, PACK 4,
head_dim 128, block 16, bf16 query, fp16 dots) and the one-warp tile (16-key sub-tiles, 1 warp, 2
stages) both run at 1000/1000's shapes, over token-major cache blocks (the engine's) and head-major
ones. Helpers from the 2026-12-03 packed-kernel count and benchmarks/quant_sass_count.py.

  cd benchmarks/results/2026-12-05-cpu-decode-stream-k-sass
  PYTHONPATH=../../.. /tmp/t36/bin/python stream_k_sass_count.py --out counts.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import triton

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(_HERE, "..", "2026-12-03-cpu-decode-packed-sass"))
sys.path.insert(0, os.path.join(_HERE, "..", ".."))  # benchmarks/: quant_sass_count
import decode_packed_sass_count as packed_count
import quant_sass_count

from kiln.kernels.triton import decode_attention_stream_k as dsk

CONSTEXPRS = dict(
    NUM_KV_HEADS=8, GROUP=4, PACK=4, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=16,
    DOT_PRECISION="tf32", FP16_DOTS=True,
)  # fmt: skip


def _stream_k_compile(head_major: bool, natural: bool = False):
    types = {
        "q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "counters_ptr": "*i32",
        "qk_scale": "fp32", "stride_q_seq": "i32", "stride_q_head": "i32",
        "stride_o_seq": "i32", "stride_o_head": "i32", "stride_bt_seq": "i32", "num_seqs": "i32",
        # As the launcher marks them: 16-byte-aligned pointers, strides divisible by 16.
        "__aligned__": ("stride_q_seq", "stride_q_head", "stride_o_seq", "stride_o_head"),
    }  # fmt: skip
    constexprs = {**CONSTEXPRS, "SCAN": 1024, "HEAD_MAJOR": head_major, "NATURAL": natural}
    if natural:  # its tile: 8-key sub-tiles, one warp, 3 stages
        constexprs["BLOCK_N"] = 8
        return quant_sass_count._compile(dsk._decode_stream_k_kernel, types, constexprs, 1, 3)
    return quant_sass_count._compile(dsk._decode_stream_k_kernel, types, constexprs, 1, 2)


def _counts(compiled) -> dict:
    cubin = compiled.asm["cubin"]
    usage = packed_count._tool("cuobjdump", cubin, "-res-usage").strip().splitlines()[-1]
    fields = dict(f.split(":") for f in usage.split() if ":" in f)
    instrs = packed_count._instructions(packed_count._tool("nvdisasm", cubin, "-c"))
    ops = collections.Counter(op for _, op, *_ in instrs)
    key_loop = None
    for lo in packed_count._loops(instrs):
        body = collections.Counter(instrs[i][1] for i in range(lo[0], lo[1] + 1))
        if any(op.startswith("HMMA") for op in body):
            key_loop = lo  # the innermost loop holding HMMAs: the key loop
    body = collections.Counter(instrs[i][1] for i in range(key_loop[0], key_loop[1] + 1))
    return {
        "registers": int(fields["REG"]),
        "stack_bytes": int(fields["STACK"]),
        "shared": compiled.metadata.shared,
        "local_stores": sum(n for op, n in ops.items() if op.startswith("STL")),
        "local_loads": sum(n for op, n in ops.items() if op.startswith("LDL")),
        "instructions": sum(n for op, n in ops.items() if not op.startswith("NOP")),
        "key_loop_instructions": sum(n for op, n in body.items() if not op.startswith("NOP")),
        "key_loop_by_class": packed_count._by_class(body),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="counts.json")
    args = parser.parse_args()
    found = {}
    for head_major in (False, True):
        layout = "_head_major" if head_major else ""
        for split in (False, True):
            constexprs = {**CONSTEXPRS, "SPLIT": split, "HEADS_FIRST": False}
            compiled = packed_count._compile({**constexprs, "HEAD_MAJOR": head_major}, 1, 2)
            found[f"packed_{'split' if split else 'unsplit'}{layout}"] = _counts(compiled)
        found[f"stream_k{layout}"] = _counts(_stream_k_compile(head_major))
        found[f"stream_k_natural{layout}"] = _counts(_stream_k_compile(head_major, True))
    for name, c in found.items():
        print(name, {k: v for k, v in c.items() if k != "key_loop_by_class"})
    with open(args.out, "w") as f:
        json.dump({"triton": triton.__version__, "target": "sm_90", "kernels": found}, f, indent=1)


if __name__ == "__main__":
    main()
