"""Compiles every kernel the transposed float8 V layout touched for Hopper (sm_90) on the CPU, at
Llama-3.1-8B shapes, and counts the float8 V loads' instructions in the attention kernels' PTX.

    PYTHONPATH=. python3 benchmarks/kv_vlayout_compile_check.py

No GPU needed: triton.compile with a GPUTarget. Pointers and the ints a launch would see as
multiples of 16 are marked so (tt.divisibility 16), as Triton's launcher specialises them, so the
vectorisation seen here is the GPU's. What it prints for the decode and prefill kernels, old
float8 layout (V as K) against transposed: the global loads by width and the asynchronous copies
into shared memory (cp.async: Triton's software pipeline), which is the question of issue 13's
V operand: with V transposed its bytes should move as K's do.
"""

from __future__ import annotations

import re
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kiln.kernels.triton import copy_blocks, decode_attention, prefill_attention, qkv_rotary, rotary

TARGET = GPUTarget("cuda", 90, 32)
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
KV_SIZE = KV_HEADS * HEAD_DIM


def compile_kernel(
    kernel, types: dict[str, str], constexprs: dict[str, object], aligned=(), warps=4, stages=3
):
    """types: each runtime argument's Triton type; aligned: those a launch sees as 16-aligned."""
    signature, names = {}, kernel.arg_names
    for name in names:
        signature[name] = "constexpr" if name in constexprs else types[name]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(kernel, signature, constexprs, attrs)
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(source, target=TARGET, options=options)


def ptx_loads(compiled) -> str:
    """The kernel's global loads (plain, by width), 16-byte asynchronous copies to shared memory,
    and shared-memory matrix loads (.trans: the 16-bit transposing one 8-bit V needed)."""
    ptx = compiled.asm["ptx"]
    found = Counter(
        re.findall(r"\b(ld\.global[\w.]*|cp\.async\.cg\.shared\.global|ldmatrix[\w.]*)", ptx)
    )
    return ", ".join(f"{name} x{n}" for name, n in sorted(found.items()))


def decode(
    v_transposed: bool, block_n=64, warps=4, stages=3, split=False, block_size=BLOCK_SIZE,
    head_dim=HEAD_DIM,
):  # fmt: skip
    k = decode_attention._decode_kernel
    ptrs = ["q_ptr", "k_cache_ptr", "v_cache_ptr", "block_tables_ptr", "seq_lens_ptr", "out_ptr",
            "part_out_ptr", "part_lse_ptr"]  # fmt: skip
    types = dict.fromkeys(k.arg_names, "i32")
    types.update(q_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
                 block_tables_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16",
                 part_out_ptr="*fp32", part_lse_ptr="*fp32", qk_scale="fp32")  # fmt: skip
    cons = dict(NUM_KV_HEADS=KV_HEADS, GROUP=4, GROUP_PAD=16, HEAD_DIM=head_dim,
                BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, BLOCK_N=block_n,
                SPLIT=split, DOT_PRECISION="ieee", FP16_DOTS=True, PREFETCH_V=not v_transposed,
                V_TRANSPOSED=v_transposed,
                V_CONTIG=min(block_size & -block_size, block_n))  # fmt: skip
    aligned = [*ptrs, "stride_q_seq", "stride_q_head", "stride_o_seq", "stride_o_head",
               "stride_bt_seq", "partition_size"]  # fmt: skip
    return compile_kernel(k, types, cons, aligned, warps, stages)


def main() -> None:
    for name, vt in (("decode, V as K (old float8)", False), ("decode, V transposed", True)):
        c = decode(vt, *((64, 4, 2) if not vt else (64, 4, 3)))  # each one's default tiles
        print(f"{name}: {ptx_loads(c)}; shared {c.metadata.shared} B")
    for cfg in ((64, 4, 2), (128, 4, 2), (128, 8, 3), (32, 4, 3)):
        c = decode(True, *cfg)
        print(f"decode V transposed {cfg}: compiled, shared {c.metadata.shared} B")
    for what, kwargs in (
        ("split-K", dict(split=True)),
        ("block 32", dict(block_size=32)),
        ("block 24 (runs of 8 keys)", dict(block_size=24)),
        ("head_dim 80 (padded to 128)", dict(head_dim=80)),
    ):
        c = decode(True, **kwargs)
        print(f"decode V transposed, {what}: {ptx_loads(c)}")

    k = prefill_attention._prefill_kernel
    types = dict.fromkeys(k.arg_names, "i32")
    types.update(q_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
                 block_tables_ptr="*i32", query_start_loc_ptr="*i32", seq_lens_ptr="*i32",
                 out_ptr="*bf16", qk_scale="fp32")  # fmt: skip
    ptrs = [n for n in k.arg_names if n.endswith("_ptr")]
    for vt in (False, True):
        cons = dict(NUM_KV_HEADS=KV_HEADS, GROUP=4, HEAD_DIM=HEAD_DIM, BLOCK_D=HEAD_DIM,
                    BLOCK_SIZE=BLOCK_SIZE, BLOCK_M=128, BLOCK_N=128, DOT_PRECISION="ieee",
                    FP16_DOTS=True, V_TRANSPOSED=vt, V_CONTIG=BLOCK_SIZE)  # fmt: skip
        aligned = [*ptrs, "stride_q_token", "stride_q_head", "stride_o_token", "stride_o_head",
                   "stride_bt_seq"]  # fmt: skip
        c = compile_kernel(k, types, cons, aligned, warps=8, stages=2)
        print(f"prefill, V {'transposed' if vt else 'as K'}: {ptx_loads(c)}")

    k = rotary._rotary_write_kv_kernel
    types = dict.fromkeys(k.arg_names, "i32")
    types.update(positions_ptr="*i64", q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16",
                 q_out_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
                 slot_mapping_ptr="*i64", cos_sin_ptr="*fp32")  # fmt: skip
    for vt in (False, True):
        cons = dict(NUM_KV_HEADS=KV_HEADS, HALF=HEAD_DIM // 2, BLOCK_H=HEADS, BLOCK_KV_H=KV_HEADS,
                    BLOCK_HALF=HEAD_DIM // 2, FP8_MAX=448.0, BLOCK_SIZE=BLOCK_SIZE,
                    V_TRANSPOSED=vt)  # fmt: skip
        compile_kernel(k, types, cons, [n for n in k.arg_names if n.endswith("_ptr")])
        print(f"rotary_write_kv, V {'transposed' if vt else 'as K'}: compiled")

    k = qkv_rotary._qkv_rotary_write_kv_kernel
    types = dict.fromkeys(k.arg_names, "i32")
    types.update(x_ptr="*bf16", residual_ptr="*bf16", norm_weight_ptr="*bf16", w_ptr="*fp8e4nv",
                 bias_ptr="*bf16", sum_ptr="*bf16", positions_ptr="*i64", cos_sin_ptr="*fp32",
                 q_out_ptr="*bf16", k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv",
                 slot_mapping_ptr="*i64", w_scale_ptr="*fp32", in_scale_ptr="*fp32",
                 part_ptr="*fp32", counter_ptr="*i32", eps="fp32")  # fmt: skip
    for vt in (False, True):
        cons = dict(Q_SIZE=HEADS * HEAD_DIM, KV_SIZE=KV_SIZE, HALF=HEAD_DIM // 2, PROLOGUE=2,
                    HAS_BIAS=False, BLOCK_N=16, BLOCK_K=256, STATS_BLOCK=1024, SPLIT_K=4,
                    DOT_PRECISION="ieee", FP8_MAX=448.0, QUANT=1, FP8_DOT=True,
                    INTERPRETED=False, BLOCK_SIZE=BLOCK_SIZE, V_TRANSPOSED=vt)  # fmt: skip
        compile_kernel(k, types, cons, [n for n in k.arg_names if n.endswith("_ptr")] + ["K"])
        print(f"qkv_rotary_write_kv (FP8 W8A8, split-K 4), V {'transposed' if vt else 'as K'}: "
              "compiled")  # fmt: skip

    k = copy_blocks._copy_blocks_kernel
    import triton.language as tl

    compile_kernel(k, {"addresses_ptr": "*i64", "mapping_ptr": "*i64", "words_per_block": "i32"},
                   {"WORD": tl.int32, "CHUNK": 1024}, ["addresses_ptr", "mapping_ptr"])  # fmt: skip
    print("copy_blocks: compiled (unchanged kernel; its launcher takes the transposed V)")


if __name__ == "__main__":
    main()
