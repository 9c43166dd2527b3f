"""Static sm_90 SASS counts of the packed float8 decode-attention kernel
(kiln/kernels/triton/decode_attention_packed.py), compiled on the CPU (no GPU needed): Triton's
ASTSource -> cubin for GPUTarget("cuda", 90, 64), then the bundled nvdisasm and cuobjdump.

At Llama-3.1-8B's constexprs (8 KV heads, GROUP 4, PACK 4, head_dim 128, block_size 16, bf16
query, fp16 dots, split) for each key loop (VARIANTS: the kernel's LOOP 1, 2, 3) and tile (keys a
sub-tile, warps, stages[, maxnreg]; TILES: decode_attention._packed_tile_config's (16, 1, 2) at
many programs an SM, (32, 2, 2) at 2-11, (16, 4, 2) below): registers a thread, shared memory,
local-memory stores and loads (spills), and the main loop's instructions (the longest backward
branch holding HMMAs; with LOOP 2/3 the unmasked loop, its masked last trip apart) divided by the
keys a trip visits (PACK * BLOCK_N), total and by opcode class; `per_key_skipped` leaves out the
forward-branched blocks inside the loop (LOOP 2/3: the accumulator's rescale, skipped on trips
where no row's maximum grew). Counts are of the code as compiled (a loop body counts once, per
warp: multiply by the warps to compare tiles), so they compare versions of the kernel at one
tile.

Run it with Triton 3.6 (the H200's version), e.g.
  python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install -q triton==3.6.0 torch==2.13.0 pyelftools
  PYTHONPATH=. /tmp/t36/bin/python benchmarks/results/2026-12-03-cpu-decode-packed-sass/decode_packed_sass_count.py --out counts.json
Options: --variant loop2 (repeatable; default all), --tile 16,1,2[,224] (repeatable; default
TILES), --sass-dir DIR (the listings).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget

from kiln.kernels.triton import decode_attention_packed as dap

_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_TARGET = GPUTarget("cuda", 90, 64)
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]+)?([^;]*);")
_BRANCH_TARGET = re.compile(r"`\(\.L_x_(\d+)\)")
_LABEL = re.compile(r"^\.L_x_(\d+):")

# (BLOCK_N, num_warps, num_stages): decode_attention._packed_tile_config's tiles.
TILES = [(16, 1, 2), (32, 2, 2), (16, 4, 2)]
# The kernel's key loops (decode_attention_packed's LOOP): 1 the first version, 2 and 3 the new.
VARIANTS: dict[str, dict] = {"loop1": {"LOOP": 1}, "loop2": {"LOOP": 2}, "loop3": {"LOOP": 3}}

# Opcode classes for the table: by the opcode's first name.
CLASSES = {
    "HMMA": ("HMMA",),
    "MOV": ("MOV", "UMOV"),
    "F2FP/PRMT/cvt": ("F2FP", "PRMT", "F2F", "I2F", "F2I"),
    "LDS/LDSM/STS": ("LDS", "LDSM", "STS"),
    "LDG/LDGSTS": ("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR"),
    "MUFU": ("MUFU",),
    "FP32 (FADD/FMUL/FFMA/FMNMX/FSEL/FSETP)": tuple(
        ["FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FCHK"]
    ),
    "integer/address (IADD3/IMAD/LEA/SHF/LOP3/ISETP/SEL)": tuple(
        [
            "IADD3",
            "IMAD",
            "LEA",
            "SHF",
            "LOP3",
            "ISETP",
            "SEL",
            "IABS",
            "IMNMX",
            "SHL",
            "SHR",
            "UIADD3",
            "UIMAD",
            "ULEA",
            "USHF",
            "ULOP3",
            "UISETP",
            "USEL",
            "ULDC",
            "S2R",
            "S2UR",
            "R2UR",
            "CS2R",
            "PLOP3",
            "P2R",
            "R2P",
            "VIADD",
            "UPRMT",
        ]
    ),
    "shuffles/barriers (SHFL/BAR/WARPSYNC)": ("SHFL", "BAR", "WARPSYNC", "BSSY", "BSYNC"),
}


def _compile(constexprs: dict, num_warps: int, num_stages: int, maxnreg: int | None = None):
    fn = dap._decode_packed_kernel
    types = {
        "q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
        "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "qk_scale": "fp32",
        "stride_q_seq": "i32", "stride_q_head": "i32", "stride_o_seq": "i32",
        "stride_o_head": "i32", "stride_bt_seq": "i32", "num_splits": "i32",
    }  # fmt: skip
    # The launcher marks 16-byte-aligned pointers and integers divisible by 16: every pointer and
    # stride here (4096-wide query rows, 128-wide heads; the block table's width is a guess).
    aligned = {"stride_q_seq", "stride_q_head", "stride_o_seq", "stride_o_head"}
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = types[name]
        if types[name].startswith("*") or name in aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = triton.compiler.ASTSource(fn, signature, constexprs, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    if maxnreg:
        options["maxnreg"] = maxnreg
    return triton.compile(src, target=_TARGET, options=options)


def _tool(name: str, cubin: bytes, *args: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run(
            [os.path.join(_BIN, name), *args, f.name], check=True, capture_output=True, text=True
        ).stdout


def _instructions(sass: str) -> list[tuple[int, str, str, int | None, int | None]]:
    """(address, opcode with modifiers, operands, label defined just before, branch target)."""
    out = []
    label = None
    for line in sass.splitlines():
        lm = _LABEL.match(line.strip())
        if lm:
            label = int(lm.group(1))
            continue
        m = _LINE.search(line)
        if not m:
            continue
        target = _BRANCH_TARGET.search(line)
        op = m.group(2) + (m.group(3) or "")
        branch = int(target.group(1)) if target else None
        out.append((int(m.group(1), 16), op, m.group(4), label, branch))
        label = None
    return out


def _loops(instrs) -> list[tuple[int, int]]:
    """(first, last) instruction indices of each backward branch's body, longest first."""
    where = {}
    for i, (_, _, _, label, _) in enumerate(instrs):
        if label is not None:
            where[label] = i
    loops = []
    for i, (_, op, _, _, target) in enumerate(instrs):
        if op.startswith("BRA") and target is not None and target in where and where[target] <= i:
            loops.append((where[target], i))
    return sorted(loops, key=lambda lo: lo[0] - lo[1])


def _by_class(ops: collections.Counter) -> dict[str, int]:
    out = dict.fromkeys(CLASSES, 0)
    out["other"] = 0
    for op, n in ops.items():
        # ptxas writes most register moves as IMAD.MOV.
        base = "MOV" if op.startswith("IMAD.MOV") else op.split(".")[0]
        for cls, names in CLASSES.items():
            if base in names:
                out[cls] += n
                break
        else:
            if base != "NOP":
                out["other"] += n
    return out


def _body(instrs, lo: tuple[int, int], keys: int) -> dict:
    """One trip's counts; `skippable`: the instructions of forward branches inside the body (the
    accumulator's rescale, skipped when no row's maximum grew), so per_key_skipped is a trip that
    skips them."""
    ops = collections.Counter(instrs[i][1] for i in range(lo[0], lo[1] + 1))
    total = sum(n for op, n in ops.items() if not op.startswith("NOP"))
    where = {label: i for i, (_, _, _, label, _) in enumerate(instrs) if label is not None}
    skippable = 0
    for i in range(lo[0], lo[1]):
        op, target = instrs[i][1], instrs[i][4]
        if op.startswith("BRA") and target in where and i < where[target] <= lo[1]:
            skippable += sum(
                not instrs[j][1].startswith(("NOP", "BSYNC")) for j in range(i + 1, where[target])
            )
    return {
        "instructions": total,
        "per_key": round(total / keys, 2),
        "skippable": skippable,
        "per_key_skipped": round((total - skippable) / keys, 2),
        "by_class": _by_class(ops),
        "by_opcode": dict(ops.most_common()),
    }


def measure(
    constexprs: dict, block_n: int, warps: int, stages: int, maxnreg: int | None = None
) -> tuple[dict, str]:
    compiled = _compile(constexprs, warps, stages, maxnreg)
    cubin = compiled.asm["cubin"]
    sass = _tool("nvdisasm", cubin, "-c")
    res = _tool("cuobjdump", cubin, "-res-usage")
    regs = re.search(r"REG:(\d+)", res)
    instrs = _instructions(sass)
    all_ops = collections.Counter(op for _, op, _, _, _ in instrs)
    keys = constexprs["PACK"] * block_n
    loops = _loops(instrs)
    entry = {
        "tile": [block_n, warps, stages],
        "registers": int(regs.group(1)) if regs else None,
        "shared_bytes": compiled.metadata.shared,
        "local_stores": sum(n for op, n in all_ops.items() if op.startswith("STL")),
        "local_loads": sum(n for op, n in all_ops.items() if op.startswith("LDL")),
        "kernel_instructions": sum(n for op, n in all_ops.items() if not op.startswith("NOP")),
        "loops": [],
    }
    # Report the loops that hold tensor-core work (the key loops), longest first.
    for lo in loops:
        if any(instrs[i][1].startswith("HMMA") for i in range(lo[0], lo[1] + 1)):
            entry["loops"].append(_body(instrs, lo, keys))
    return entry, sass


def constexprs_for(variant: dict, block_n: int) -> dict:
    base = {
        "NUM_KV_HEADS": 8, "GROUP": 4, "PACK": 4, "HEAD_DIM": 128, "BLOCK_SIZE": 16,
        "BLOCK_N": block_n, "SPLIT": True, "DOT_PRECISION": "ieee", "FP16_DOTS": True,
        "HEADS_FIRST": False,
    }  # fmt: skip
    base.update(variant)
    # Only the kernel's own constexprs (a variant may name one an older kernel lacks).
    return {k: v for k, v in base.items() if k in dap._decode_packed_kernel.arg_names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="write the counts as JSON here")
    parser.add_argument("--sass-dir", help="write each kernel's SASS listing here")
    parser.add_argument("--variant", action="append", help="of VARIANTS (default: all)")
    parser.add_argument(
        "--tile", action="append", help="BLOCK_N,warps,stages[,maxnreg] (default: TILES)"
    )
    args = parser.parse_args()
    tiles = [tuple(int(x) for x in t.split(",")) for t in args.tile] if args.tile else TILES
    tiles = [t if len(t) == 4 else (*t, None) for t in tiles]
    results: dict = {"triton": triton.__version__, "target": "sm_90", "kernels": []}
    for name in args.variant or list(VARIANTS):
        for block_n, warps, stages, maxnreg in tiles:
            constexprs = constexprs_for(VARIANTS[name], block_n)
            entry, sass = measure(constexprs, block_n, warps, stages, maxnreg)
            entry["maxnreg"] = maxnreg
            entry["variant"] = name
            results["kernels"].append(entry)
            main_loop = entry["loops"][0] if entry["loops"] else {}
            print(
                f"{name:6s} tile {block_n},{warps},{stages} maxnreg {maxnreg}: "
                f"regs {entry['registers']} STL {entry['local_stores']} "
                f"LDL {entry['local_loads']} smem {entry['shared_bytes']} "
                f"loop {main_loop.get('instructions')} instr = {main_loop.get('per_key')} a key "
                f"({main_loop.get('per_key_skipped')} skipping the rescale) "
                f"{main_loop.get('by_class')}",
                file=sys.stderr,
            )
            if args.sass_dir:
                os.makedirs(args.sass_dir, exist_ok=True)
                tag = f"{name}_{block_n}_{warps}_{stages}" + (f"_r{maxnreg}" if maxnreg else "")
                path = os.path.join(args.sass_dir, tag + ".sass")
                with open(path, "w") as f:
                    f.write(sass)
    text = json.dumps(results, indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
