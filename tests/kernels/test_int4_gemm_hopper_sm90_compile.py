"""The Gluon W4A16 kernel (kiln.kernels.triton.int4_gemm_hopper) compiled for an H100 (sm_90) on
the CPU, as a GPU run would JIT it, and its main loop read back from the SASS (cuobjdump ships with
Triton): the weights go from one 16-byte load a lane straight into mma.sync's A registers (no
shared memory in the loop, no local memory anywhere, ptxas spills nothing), seven integer
instructions a word of 8 codes, and the loop issues a fraction of the instructions a code of the
small-batch kernel it replaces (int4_gemm._int4_small_batch_kernel, compiled the same way).
Compiles only, in a subprocess without TRITON_INTERPRET. The values come from
tests/kernels/test_int4_gemm_hopper.py on a GPU, the speed from benchmarks/kernels_gpu.py."""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from tests.kernels.sm90_compile import compiled_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")
pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")
pytest.importorskip("triton.experimental.gluon", reason="triton without Gluon")

from kiln.kernels.triton import int4_gemm_hopper as hopper

# (rows, dtype, group size, ZERO_IS_MIN, bias) at Llama-3.1-8B's o_proj (4096 -> 4096):
# decode's one row, eight rows with groups of 32 (two a loop step) and GGUF's mins, a 16-row
# tile per channel, concurrency 32's 32 rows.
_CASES = (
    (1, "bf16", 128, False, False),
    (8, "fp16", 32, True, True),
    (16, "bf16", 4096, False, False),
    (32, "bf16", 128, False, False),
)
_NAMES = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr", "part_ptr", "counter_ptr", "M",
          "N", "K", "stride_xm", "stride_ym", "stride_wt", "groups", "steps_per_split")  # fmt: skip
# Arguments Triton's launcher would see as multiples of 16 (pointers from torch, K and strides).
_ALIGNED = ("x_ptr", "w_ptr", "s_ptr", "z_ptr", "b_ptr", "y_ptr", "part_ptr", "counter_ptr", "K",
            "stride_xm", "stride_ym", "stride_wt")  # fmt: skip


def _tools() -> tuple[str, str]:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    return ptxas, str(Path(ptxas).parent / "cuobjdump")


def _finish(compiled) -> dict[str, str]:
    """PTX, ptxas's report and the SASS of a compiled kernel."""
    ptx = compiled.asm["ptx"]
    ptxas, cuobjdump = _tools()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        report = subprocess.run([ptxas, "-arch=sm_90a", "-v", str(path), "-o",
                                 str(Path(tmp) / "kernel.cubin")],
                                capture_output=True, text=True, check=True)  # fmt: skip
        cubin = Path(tmp) / "triton.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True,
                              check=True).stdout  # fmt: skip
    return {"ptx": ptx, "ptxas": report.stdout + report.stderr, "sass": sass}


def _compile(rows: int, dtype: str, group: int, zero_is_min: bool, bias: bool) -> dict[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float16
    _, _, meta = hopper.launch_config(rows, 4096, 4096, group, torch_dtype, torch.device("cpu"))
    num_warps = meta.pop("num_warps")
    meta.update(HAS_BIAS=bias, ZERO_IS_MIN=zero_is_min)
    types = [f"*{dtype}", "*i32", "*fp32", "*fp32", f"*{dtype}", f"*{dtype}", "*fp32", "*i32"]
    signature = {**dict(zip(_NAMES, types + ["i32"] * 8)), **dict.fromkeys(meta, "constexpr")}
    attrs = {(_NAMES.index(name),): [["tt.divisibility", 16]] for name in _ALIGNED}
    source = GluonASTSource(fn=hopper._int4_mma_kernel, signature=signature, constexprs=meta,
                            attrs=attrs)  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    return {**_finish(compiled), "split_k": str(meta["SPLIT_K"])}


def _compile_small_batch(rows: int = 1, relaid: bool = False) -> dict[str, str]:
    """int4_gemm's small-batch kernel at its launch's constexprs for Llama-3.1-8B's o_proj (one
    row: registers; 2-8: tl.dot), over kiln's layout or the re-laid codes (MMA_LAYOUT)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kiln.kernels.triton import int4_gemm

    names = (*_NAMES[:13], "groups", "group_size", "k_per_split")
    types = ["*bf16", "*i32", "*fp32", "*fp32", "*fp32", "*bf16", "*fp32", "*i32"] + ["i32"] * 8
    dot = rows > 1
    meta = {"HAS_BIAS": False, "ROWS": 16 if dot else 1, "BLOCK_N": 64 if dot else 128,
            "BLOCK_K": 128, "SPLIT_K": 8, "DOT": dot, "PRECISION": "tf32",
            "ZERO_IS_MIN": False, "MMA_LAYOUT": relaid}  # fmt: skip
    signature = {**dict(zip(names, types)), **dict.fromkeys(meta, "constexpr")}
    aligned = [i for i, name in enumerate(names) if name in _ALIGNED or name == "k_per_split"]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    source = ASTSource(fn=int4_gemm._int4_small_batch_kernel, signature=signature,
                       constexprs=meta, attrs=attrs)  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})  # fmt: skip
    return {**_finish(compiled), "codes_a_step": str(128 * 128)}


def _compile_tiled(relaid: bool) -> dict[str, str]:
    """int4_gemm's 9+ row tl.dot kernel (64-row tiles) over kiln's layout or the re-laid codes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kiln.kernels.triton import int4_gemm

    names = (*_NAMES[:4], "b_ptr", "y_ptr", "M", "N", "K", "stride_xm", "stride_ym", "groups",
             "group_size")  # fmt: skip
    types = ["*bf16", "*i32", "*fp32", "*fp32", "*bf16", "*bf16"] + ["i32"] * 7
    meta = {"HAS_BIAS": False, "PRECISION": "tf32", "BLOCK_M": 64, "BLOCK_N": 64,
            "BLOCK_K": 64, "ZERO_IS_MIN": False, "MMA_LAYOUT": relaid}  # fmt: skip
    signature = {**dict(zip(names, types)), **dict.fromkeys(meta, "constexpr")}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names) if name in _ALIGNED}
    source = ASTSource(fn=int4_gemm._int4_gemm_kernel, signature=signature, constexprs=meta,
                       attrs=attrs)  # fmt: skip
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4, "num_stages": 3})  # fmt: skip
    return _finish(compiled)


def main_loop(sass: str) -> list[str]:
    """The instructions of the innermost loop that holds the kernel's arithmetic (HMMA or FFMA):
    from a backward branch's target to the branch."""
    lines = [line for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4}\*/", line)]

    def address(line: str) -> int:
        return int(re.match(r"\s*/\*([0-9a-f]+)\*/", line)[1], 16)  # type: ignore[index]

    loops = []
    for line in lines:
        branch = re.search(r"BRA (0x[0-9a-f]+)", line)
        if branch and int(branch[1], 16) < address(line):
            body = [x for x in lines if int(branch[1], 16) <= address(x) <= address(line)]
            if any(op in x for x in body for op in ("HMMA", "FFMA")):
                loops.append(body)
    assert loops, "no loop found in the SASS"
    return min(loops, key=len)


def opcodes(body: list[str]) -> collections.Counter:
    """Opcode counts (predicates and modifiers dropped: LDG.E.128 counts as LDG)."""
    ops = (re.sub(r"^\s*/\*[0-9a-f]+\*/\s*(@!?U?P\w+\s+)?", "", line).split()[0] for line in body)
    return collections.Counter(op.split(".")[0] for op in ops)


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, str]]:
    return compiled_in_subprocess(__file__)


def _case(compiled: dict, case: tuple) -> dict[str, str]:
    return compiled[" ".join(map(str, case))]


@pytest.mark.parametrize("case", _CASES)
def test_the_weights_go_from_one_wide_load_to_the_mma_registers(compiled, case) -> None:
    rows = case[0]
    got = _case(compiled, case)
    body = main_loop(got["sass"])
    ops = opcodes(body)
    tiles = max(rows, 8) // 8  # the MMA's N is 8 rows
    # Two loop steps an iteration, four k16 MMAs each, and as many of all-ones A for sum(x).
    assert ops["HMMA"] == 16 * tiles
    assert "mma.sync.aligned.m16n8k16.row.col.f32" in got["ptx"]
    # One 16-byte load of codes a lane a step, two of x a row tile, no shared memory.
    wide = [line for line in body if "LDG.E.128" in line]
    assert len(wide) == 2 * (1 + 2 * tiles), wide
    assert not [line for line in body if re.search(r"\b(STS|LDS|LDSM)\b", line)]
    # The whole kernel's shared memory: the split-K ticket's broadcast only.
    assert got["ptx"].count("st.shared") <= 1
    # Each word: three shifts and four LOP3s (one a pair of codes: AND and OR in one).
    assert ops["LOP3"] >= 32 and ops["SHF"] >= 24


@pytest.mark.parametrize("case", _CASES)
def test_nothing_spills(compiled, case) -> None:
    got = _case(compiled, case)
    assert "ld.local" not in got["ptx"] and "st.local" not in got["ptx"]
    spilled = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", got["ptxas"])
    assert spilled is not None and spilled[1] == "0" and spilled[2] == "0", got["ptxas"]


def test_a_code_costs_a_fraction_of_the_small_batch_kernels_instructions(compiled) -> None:
    """SASS instructions of the main loop per code of a lane, at one row: Triton 3.6 2.09 (134
    for 64 codes) against the small-batch kernel's 7.65; Triton 3.9 2.02 against 7.54."""
    new = len(main_loop(_case(compiled, _CASES[0])["sass"])) / 64  # 8 words of 8 codes a lane
    old_case = compiled["small_batch"]
    old = len(main_loop(old_case["sass"])) * 128 / int(old_case["codes_a_step"])
    print(f"SASS instructions a code: Gluon {new:.2f}, small-batch {old:.2f}")
    assert new <= 2.5 and new * 3 < old


@pytest.mark.parametrize("kernel", ["small_batch_relaid", "small_batch_dot_relaid",
                                    "tiled_relaid"])  # fmt: skip
def test_int4_gemms_kernels_compile_over_the_relaid_codes(compiled, kernel) -> None:
    """A layer that keeps only the re-laid codes runs int4_gemm's kernels over them where the
    Gluon kernel does not apply (MMA_LAYOUT): they compile for sm_90 with nothing spilled."""
    got = compiled[kernel]
    assert "ld.local" not in got["ptx"] and "st.local" not in got["ptx"]
    spilled = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", got["ptxas"])
    assert spilled is not None and spilled[1] == "0" and spilled[2] == "0", got["ptxas"]


def test_launch_config_splits_k_for_enough_programs() -> None:
    # o_proj at one row: 64 column tiles, split 16 ways (1,024 programs on 132 SMs).
    grid, per, meta = hopper.launch_config(1, 4096, 4096, 128, torch.bfloat16,
                                           torch.device("cpu"))  # fmt: skip
    assert grid == (64, 16, 1) and per == 4 and meta["SPLIT_K"] == 16 and meta["ROWS"] == 8
    # gate_up: 448 tiles, two splits.
    grid, per, meta = hopper.launch_config(8, 28672, 4096, 128, torch.bfloat16,
                                           torch.device("cpu"))  # fmt: skip
    assert grid == (448, 2, 1) and per == 32
    # 20 rows: one tile of 32; groups of 32 take two a step, per channel every step group 0.
    _, _, meta = hopper.launch_config(20, 4096, 4096, 32, torch.float16, torch.device("cpu"))
    assert meta["ROWS"] == 32 and meta["GROUP32"] and meta["OFFSET"] == 1024.0
    assert hopper.group_shift(4096, 4096) == 31 and hopper.group_shift(4096, 256) == 2
    assert hopper.group_shift(4096, 16) is None and hopper.group_shift(4096, 192) is None
    assert hopper.group_shift(4224, 64) == 0 and hopper.group_shift(4160, 64) is None


def test_support_is_sm90_and_selection() -> None:
    x = torch.zeros(1, 4096, dtype=torch.bfloat16)
    # Selected after its GPU tests passed and it beat int4_gemm's kernels on an H100.
    assert {torch.bfloat16, torch.float16} == hopper.SELECTED
    assert not hopper.supports(x, 4096, 128) and not hopper.applies(x, 4096, 128)
    assert not hopper.usable(torch.device("cpu"), 4096, 128)
    if torch.cuda.is_available():
        gpu = x.cuda()
        sm90 = torch.cuda.get_device_capability() == (9, 0)
        assert hopper.supports(gpu, 4096, 128) == sm90
        assert not hopper.supports(gpu.float(), 4096, 128)
        assert not hopper.supports(torch.zeros(33, 4096, dtype=torch.bfloat16).cuda(), 4096, 128)
        assert not hopper.supports(gpu, 4096, 16)


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    results = {" ".join(map(str, case)): _compile(*case) for case in _CASES}
    results["small_batch"] = _compile_small_batch()
    results["small_batch_relaid"] = _compile_small_batch(relaid=True)
    results["small_batch_dot_relaid"] = _compile_small_batch(rows=8, relaid=True)
    results["tiled_relaid"] = _compile_tiled(relaid=True)
    json.dump(results, sys.stdout)
