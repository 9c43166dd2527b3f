"""Multi-head latent attention's kernels compiled for an H100 (sm_90) on the CPU, as a GPU run
would JIT them, at DeepSeek's real row (64 rotary + 512 latent dims, bf16): the MLA decode
kernel over a bf16 and over a float8 cache (rows widened in registers), the shared decode's
merge (which merges its partitions), and the shared prefill and decode kernels at the tiles a
GPU takes for a 576-wide head (16 query heads a KV head: V2-Lite's, V3's per rank at TP=8).
Each must fit an H100's 227 KiB of shared memory (the shared kernels' usual tiles need 262 KiB
and more at this width); the MLA decode's dots run on the tensor cores and ptxas spills nothing
of it. The MLA decode is compiled with the arguments' specialization a launch at V3's 128, 64,
32 and 16 heads a rank (TP=1, 2, 4, 8) gives (every one a program of 16 heads; the count only
sizes the grid). Compiles only, in a subprocess without TRITON_INTERPRET; never run or timed on
a GPU here. Passes with Triton 3.6 (the GPU machines': PYTHONPATH=<its install>) and 3.9."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.kernels.sm90_compile import compiled_in_subprocess, ptxas_report, spilled_bytes

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")
pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")

H100_SHARED_BYTES = 227 * 1024
V3_HEADS_A_RANK = {"tp1": 128, "tp2": 64, "tp4": 32, "tp8": 16}
CACHES = ("bf16", "fp8")


def _compile(
    fn, signature: dict, constants: dict, num_warps: int, num_stages: int,
    aligned: tuple[str, ...] = (), spills: bool = False,
) -> dict:  # fmt: skip
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    ptx = kernel.asm["ptx"]
    got = {"shared": kernel.metadata.shared, "mma": "mma" in ptx}
    if spills:
        got["spilled"] = spilled_bytes(ptxas_report(ptx))
        got["local"] = "ld.local" in ptx or "st.local" in ptx
        got["byte_reads"] = bool(re.search(r"ld\.shared\.[bu]8", ptx))
    return got


def _launch_specialization(values: dict[str, int]) -> tuple[dict, tuple[str, ...]]:
    """The integer arguments as Triton's launcher specializes them: a 1 becomes a constant,
    a multiple of 16 is marked divisible by 16 (torch's allocations: every pointer too)."""
    constants = {name: 1 for name, value in values.items() if value == 1}
    aligned = tuple(name for name, value in values.items() if value != 1 and value % 16 == 0)
    return constants, aligned


def _mla_decode_cases() -> dict[str, tuple]:
    """(signature, constants, aligned) of the MLA decode at V3's shapes for each heads a rank,
    cache dtype and split: a bf16 query, blocks of 16, tables of 256 blocks (4k keys)."""
    from kiln.kernels.triton import mla_decode

    pointers = {"q_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
                "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
                "part_lse_ptr": "*fp32"}  # fmt: skip
    ints = ("stride_q_seq", "stride_q_head", "stride_bt_seq", "stride_o_seq", "stride_o_head",
            "num_heads", "num_splits")  # fmt: skip
    cases = {}
    for tp, heads in V3_HEADS_A_RANK.items():
        for cache in CACHES:
            for split in (False, True):
                values = dict(zip(ints, (heads * 576, 576, 256, heads * 512, 512, heads,
                                         4 if split else 1)))  # fmt: skip
                constants, aligned = _launch_specialization(values)
                signature = {**pointers, "cache_ptr": "*fp8e4nv" if cache == "fp8" else "*bf16",
                             "scale_log2": "fp32"}  # fmt: skip
                signature.update({n: "i32" for n in ints if n not in constants})
                constants.update(ROPE=64, LORA=512, ROPE_PAD=64, LORA_PAD=512, BLOCK_SIZE=16,
                                 BLOCK_H=mla_decode._BLOCK_H, BLOCK_N=32, SPLIT=split,
                                 DOT_PRECISION="tf32", CACHE_FP8=cache == "fp8",
                                 ASM_WIDEN=cache == "fp8")  # fmt: skip
                cases[f"mla decode {tp} {cache} split={split}"] = (
                    signature,
                    constants,
                    (*pointers, *aligned),
                )
    return cases


def _compile_all() -> dict[str, dict]:
    import torch

    from kiln.kernels.triton import decode_attention, mla_decode, prefill_attention

    cuda, out = torch.device("cuda"), {}
    programs: dict[str, dict] = {}  # by specialization: the heads counts share one program
    for name, (signature, constants, aligned) in _mla_decode_cases().items():
        key = json.dumps([signature, constants, aligned], sort_keys=True)
        if key not in programs:
            programs[key] = _compile(mla_decode._mla_decode_kernel, signature, constants, 4, 2,
                                     aligned, spills=True)  # fmt: skip
        out[name] = {**programs[key], "program": list(programs).index(key)}
    out["shared merge"] = _compile(  # the MLA decode's partitions merged, 512 latent dims wide
        decode_attention._decode_reduce_kernel,
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
         "stride_o_seq": "i32", "stride_o_head": "i32", "num_splits": "i32"},
        {"NUM_HEADS": 16, "HEAD_DIM": 512, "BLOCK_D": 512, "SPLITS_PAD": 32}, 4, 1,
    )  # fmt: skip
    shared = {"NUM_KV_HEADS": 1, "HEAD_DIM": 576, "BLOCK_D": 1024, "BLOCK_SIZE": 16,
              "DOT_PRECISION": "tf32", "FP16_DOTS": False, "SLIDING": False, "SOFTCAP": False,
              "SINKS": False}  # fmt: skip
    prefill = prefill_attention._prefill_kernel
    for cache in CACHES:  # a float8 cache: Q.K as float8 dots (the Triton backend's prefill)
        fp8 = cache == "fp8"
        cache_type = "*fp8e4nv" if fp8 else "*bf16"
        block_m, block_n, warps, stages = prefill_attention._tile_config(
            576, 4096, 16, 1, cuda, "fp8_qk" if fp8 else "bf16"
        )
        out["shared prefill" + (" fp8" if fp8 else "")] = _compile(
            prefill,
            {name: ("*i32" if name in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")
                    else cache_type if name in ("k_cache_ptr", "v_cache_ptr")
                    else "*bf16" if name.endswith("_ptr")
                    else "fp32" if name in ("qk_scale", "softcap_in", "softcap_out") else "i32")
             for name in prefill.arg_names[:17]},
            {**shared, "GROUP": 16, "BLOCK_M": block_m, "BLOCK_N": block_n, "FP8_QK": fp8,
             "INTERPRETED": False, "FP16_DOTS": fp8},
            warps, stages,
        )  # fmt: skip
    block_n, warps, stages = decode_attention._tile_config(16, cuda, head_dim=576)
    decode = decode_attention._decode_kernel
    floats = ("qk_scale", "softcap_in", "softcap_out")
    out["shared decode"] = _compile(
        decode,
        {name: ("*i32" if name in ("block_tables_ptr", "seq_lens_ptr")
                else "*fp32" if name in ("part_out_ptr", "part_lse_ptr")
                else "*bf16" if name.endswith("_ptr") else "fp32" if name in floats else "i32")
         for name in decode.arg_names[:19]},
        {**shared, "GROUP": 16, "GROUP_PAD": 16, "BLOCK_N": block_n, "SPLIT": True,
         "PREFETCH_V": False, "HEADS_FIRST": True},
        warps, stages,
    )  # fmt: skip
    return out


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return compiled_in_subprocess(__file__)


def _mla(compiled: dict) -> dict[str, dict]:
    return {name: got for name, got in compiled.items() if name.startswith("mla decode")}


def test_every_kernel_fits_an_h100s_shared_memory(compiled) -> None:
    mla = {f"mla decode {tp} {cache} split={split}" for tp in V3_HEADS_A_RANK
           for cache in CACHES for split in (False, True)}  # fmt: skip
    assert set(compiled) == {*mla, "shared merge", "shared prefill", "shared prefill fp8",
                             "shared decode"}  # fmt: skip
    for name, kernel in compiled.items():
        assert kernel["shared"] <= H100_SHARED_BYTES, (name, kernel["shared"])


def test_the_heads_a_rank_share_one_program_per_cache_and_split(compiled) -> None:
    """V3's 16 to 128 heads a rank: the same specialization, so the same program (and the
    same shared memory), one for each cache dtype and split."""
    mla = _mla(compiled)
    for cache in CACHES:
        for split in (False, True):
            got = {mla[f"mla decode {tp} {cache} split={split}"]["program"]
                   for tp in V3_HEADS_A_RANK}  # fmt: skip
            assert len(got) == 1, (cache, split, got)
    assert len({got["program"] for got in mla.values()}) == 2 * len(CACHES)


def test_the_mla_decode_dots_run_on_the_tensor_cores_without_spilling(compiled) -> None:
    for name, got in _mla(compiled).items():
        assert got["mma"], name
        assert got["spilled"] == [0, 0] and not got["local"], (name, got)


def test_a_float8_cache_reaches_shared_memory_widened(compiled) -> None:
    """The float8 rows are widened before they reach shared memory for the dots: no tile read
    back a byte at a time (what a plain .to() after the load compiles to)."""
    for name, got in _mla(compiled).items():
        assert not got["byte_reads"], name


if __name__ == "__main__":
    json.dump(_compile_all(), sys.stdout)
