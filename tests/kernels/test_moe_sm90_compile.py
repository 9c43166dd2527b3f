"""The MoE kernels compiled for an H100 (sm_90) on the CPU, as a GPU run would JIT them: catches
what the interpreter cannot (a tile Triton cannot lower, float8 dots off the tensor cores, loops
left unpipelined). Compiles only, in a subprocess without TRITON_INTERPRET (the interpreter
replaces the kernels' JIT functions); the numbers come from benchmarks/kernels_gpu.py --only moe."""

from __future__ import annotations

import json
import re
import sys

import pytest

from tests.kernels.sm90_compile import compiled_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")
pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")

# Runtime ints the real launches pass as multiples of 16 are specialized so (Triton's JIT does
# this by value); these are not (top_k 8, per-expert scale strides 1 and 0, counts).
_NOT_DIVISIBLE = {"top_k", "stride_se", "stride_sn", "num_experts", "num_pairs", "eps", "alpha",
                  "limit", "stride_shared_gate"}  # fmt: skip
_ASYNC_COPY = re.compile(r"cp\.async\.c[ag]\.")  # a global-to-shared copy, not a commit
_STRIDES = ("stride_we", "stride_wn", "stride_se", "stride_sn", "stride_out")


def _ptx(fn, signature: dict, constants: dict, num_warps: int = 4, num_stages: int = 3) -> str:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    attrs = {
        (fn.arg_names.index(name),): [["tt.divisibility", 16]]
        for name, kind in signature.items()
        if kind != "constexpr" and not kind.startswith("tensordesc") and name not in _NOT_DIVISIBLE
    }
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs=attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def _compile_all() -> dict[str, str]:
    """Each case's PTX: the decode kernels at their default tiles (bf16 and float8 weights; the
    split down variant too; routed, normed, biased, clamped and shared variants),
    the float8 grouped GEMM at its default tiles (pointer loads and TMA), the router."""
    import importlib

    from kiln.kernels.triton import moe_decode, moe_fp8, moe_router

    # The module, not the package's function of the same name.
    fused_moe = importlib.import_module("kiln.kernels.triton.fused_moe")

    ptx = {}
    gate_up_args = {
        "x_ptr": "*bf16", "norm_ptr": "*bf16", "logits_ptr": "*bf16", "w_ptr": "*bf16",
        "scale_ptr": "*fp32", "zero_ptr": "*fp32", "bias_ptr": "*bf16", "ids_ptr": "*i64",
        "weights_ptr": "*fp32", "out_ptr": "*bf16", "top_k": "i32", "N": "i32", "K": "i32",
        "num_experts": "i32", "eps": "fp32", "alpha": "fp32", "limit": "fp32", "stride_x": "i32",
        "stride_logits": "i32", "stride_be": "i32", **dict.fromkeys(_STRIDES, "i32"),
    }  # fmt: skip
    plain = {"NORMED": False, "ROUTED": False, "TOP_K": 8, "RENORMALIZE": True, "ROUND": True,
             "BLOCK_E": 128, "BLOCK_TOP_K": 8, "HAS_BIAS": False, "SWIGLU": False}  # fmt: skip
    down_sum_args = {
        "h_ptr": "*bf16", "w_ptr": "*bf16", "scale_ptr": "*fp32", "zero_ptr": "*fp32",
        "ids_ptr": "*i64", "weights_ptr": "*fp32", "bias_ptr": "*bf16", "shared_ptr": "*bf16",
        "shared_gate_ptr": "*bf16", "out_ptr": "*bf16", "top_k": "i32", "N": "i32", "K": "i32",
        "stride_h": "i32", "stride_be": "i32", "stride_shared": "i32",
        "stride_shared_gate": "i32", **dict.fromkeys(_STRIDES, "i32"),
    }  # fmt: skip
    down_args = {
        "h_ptr": "*bf16", "scale_ptr": "*fp32", "zero_ptr": "*fp32", "ids_ptr": "*i64",
        "weights_ptr": "*fp32", "bias_ptr": "*bf16", "out_ptr": "*fp32", "N": "i32", "K": "i32",
        "K_CHUNK": "i32", "stride_h": "i32", "stride_be": "i32",
        **dict.fromkeys(_STRIDES, "i32"),
    }  # fmt: skip
    # (name suffix, gate_up's variant, down_sum's): the plain kernels, Qwen3-MoE's routed and
    # normed decode, gpt-oss's biased and clamped experts, Qwen2-MoE's shared expert.
    variants = (
        ("", {}, {"HAS_BIAS": False, "SHARED": False}),
        (" routed", {"NORMED": True, "ROUTED": True}, {"HAS_BIAS": False, "SHARED": True}),
        (" biased", {"ROUTED": True, "HAS_BIAS": True, "SWIGLU": True, "BLOCK_E": 32,
                     "BLOCK_TOP_K": 4, "TOP_K": 4}, {"HAS_BIAS": True, "SHARED": False}),
    )  # fmt: skip
    # i32: INT4 experts' packed words; i8: 8-bit integer experts (kiln.layers.moe_w8a16)
    for weight in ("bf16", "fp8e4nv", "i32", "i8"):
        scaled, int4 = weight in ("fp8e4nv", "i8"), weight == "i32"
        # per-channel float8 (block: moe_fp8_block); INT4 in groups of 128
        scales = {"SCALED": scaled, "BLOCK_SCALED": False, "INT4": int4, "GROUP": 128}
        block_k = moe_decode._INT4_BLOCK_K if int4 else moe_decode._ROW_BYTES // (2 - scaled)
        stages = moe_decode._NUM_STAGES
        for suffix, gate_up_variant, down_variant in variants:
            ptx[f"gate_up {weight}{suffix}"] = _ptx(
                moe_decode._gate_up_act_kernel, {**gate_up_args, "w_ptr": f"*{weight}"},
                {**scales, **plain, **gate_up_variant, "INTERPRETED": False,
                 "BLOCK_N": 16, "BLOCK_K": block_k, "NUM_STAGES": stages},
            )  # fmt: skip
            ptx[f"down_sum {weight}{suffix}"] = _ptx(
                moe_decode._down_sum_kernel, {**down_sum_args, "w_ptr": f"*{weight}"},
                {**scales, **down_variant, "BLOCK_N": 8, "BLOCK_K": block_k,
                 "NUM_STAGES": stages},
            )  # fmt: skip
        ptx[f"down {weight}"] = _ptx(
            moe_decode._down_kernel, {**down_args, "w_ptr": f"*{weight}"},
            {**scales, "HAS_BIAS": True, "BLOCK_N": 32, "BLOCK_K": block_k,
             "NUM_STAGES": stages},
        )  # fmt: skip
    # Block-scaled float8 (a scale per row and 128 inputs) at per-channel float8's tiles.
    block = {"SCALED": True, "BLOCK_SCALED": True, "INT4": False, "GROUP": 128}
    fp8_k = moe_decode._ROW_BYTES
    ptx["gate_up fp8_block"] = _ptx(
        moe_decode._gate_up_act_kernel, {**gate_up_args, "w_ptr": "*fp8e4nv"},
        {**block, **plain, "INTERPRETED": False, "BLOCK_N": 16, "BLOCK_K": fp8_k,
         "NUM_STAGES": stages},
    )  # fmt: skip
    ptx["down_sum fp8_block"] = _ptx(
        moe_decode._down_sum_kernel, {**down_sum_args, "w_ptr": "*fp8e4nv"},
        {**block, **variants[0][2], "BLOCK_N": 8, "BLOCK_K": fp8_k, "NUM_STAGES": stages},
    )  # fmt: skip
    ptx["down fp8_block"] = _ptx(
        moe_decode._down_kernel, {**down_args, "w_ptr": "*fp8e4nv"},
        {**block, "HAS_BIAS": True, "BLOCK_N": 32, "BLOCK_K": fp8_k, "NUM_STAGES": stages},
    )  # fmt: skip
    # The default tiles with and without TMA, and the prefill-sized ones as they run.
    default_tma = (*moe_fp8.DEFAULT_TILES[:5], 1)
    for name, tiles in (("tma=0", moe_fp8.DEFAULT_TILES), ("tma=1", default_tma),
                        ("large", moe_fp8.LARGE_TILES)):  # fmt: skip
        block_m, block_n, block_k, num_warps, num_stages, tma = tiles
        ptx[f"fp8 gemm {name}"] = _ptx(
            moe_fp8._fp8_grouped_gemm_kernel,
            {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv",
             **({"w_desc": f"tensordesc<fp8e4nv[{block_n}, {block_k}]>"} if tma else {}),
             "w_scale_ptr": "*fp32", "out_ptr": "*bf16", "weights_ptr": "*fp32",
             "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_rows_ptr": "*i32",
             "num_pairs": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
             "stride_we": "i32", "stride_wn": "i32", "stride_se": "i32", "stride_sn": "i32",
             "stride_out": "i32"},
            {**({} if tma else {"w_desc": None}), "A_PER_ROW": 8, "MUL_WEIGHT": False,
             "EVEN_K": True, "INTERPRETED": False, "TMA": bool(tma), "BLOCK_M": block_m,
             "BLOCK_N": block_n, "BLOCK_K": block_k},
            num_warps, num_stages,
        )  # fmt: skip
    gemm_args = {
        "a_ptr": "*bf16", "out_ptr": "*bf16", "weights_ptr": "*fp32",
        "scale_ptr": "*fp32", "zero_ptr": "*fp32", "bias_ptr": "*bf16",
        "sorted_pairs_ptr": "*i32", "block_experts_ptr": "*i32", "num_rows_ptr": "*i32",
        "num_pairs": "i32", "num_experts": "i32", "N": "i32", "K": "i32", "stride_a": "i32",
        "stride_we": "i32", "stride_wn": "i32", "stride_out": "i32", "stride_se": "i32",
        "stride_sn": "i32",
    }  # fmt: skip
    gemm = {"A_PER_ROW": 8, "MUL_WEIGHT": False, "HAS_BIAS": False, "GROUP": 128,
            "DOT_PRECISION": "tf32", "INTERPRETED": False, "BLOCK_M": 64, "BLOCK_N": 128,
            "BLOCK_K": 64}  # fmt: skip
    # (name, weights, SCALED, PER_CHANNEL, ROW_BLOCKS, INT4): INT4 groups; int8 per channel
    # and in groups of 128 (weight-only: widened onto the bf16 tensor cores).
    for name, weight, scaled, channel, row_blocks, int4 in (
        ("int4 gemm", "*i32", False, False, False, True),
        ("int8 gemm", "*i8", True, True, False, False),
        ("int8 g128 gemm", "*i8", True, False, True, False),
    ):
        ptx[name] = _ptx(
            fused_moe._grouped_gemm_kernel, {**gemm_args, "w_ptr": weight},
            {**gemm, "SCALED": scaled, "PER_CHANNEL": channel, "ROW_BLOCKS": row_blocks,
             "INT4": int4},
        )  # fmt: skip
    router_args = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64",
                   "bias_ptr": "*fp32", "num_experts": "i32", "stride_logits": "i32",
                   "group_size": "i32", "scaling": "fp32"}  # fmt: skip
    ptx["router"] = _ptx(
        moe_router._route_kernel, router_args,
        {"TOP_K": 8, "RENORMALIZE": True, "ROUND": True, "BLOCK_E": 128, "BLOCK_K": 8,
         "SIGMOID": False, "N_GROUP": 1, "TOPK_GROUP": 1, "BLOCK_G": 1},
        num_warps=1,
    )  # fmt: skip
    ptx["sigmoid router"] = _ptx(  # DeepSeek-V3's shape: 256 experts in 8 groups, top 4 groups
        moe_router._route_kernel, router_args,
        {"TOP_K": 8, "RENORMALIZE": True, "ROUND": False, "BLOCK_E": 256, "BLOCK_K": 8,
         "SIGMOID": True, "N_GROUP": 8, "TOPK_GROUP": 4, "BLOCK_G": 8},
        num_warps=1,
    )  # fmt: skip
    return ptx


@pytest.fixture(scope="module")
def ptx() -> dict[str, str]:
    return compiled_in_subprocess(__file__)


def test_decode_kernels_pipeline_their_weight_loads(ptx) -> None:
    for weight in ("bf16", "fp8e4nv", "i32", "i8"):
        for kernel in ("gate_up", "down_sum", "down"):
            # Weight tiles staged in shared memory ahead of use; the slot loop's expert ids too.
            assert "cp.async" in ptx[f"{kernel} {weight}"], (kernel, weight)
        for suffix in ("routed", "biased"):  # the routed, normed, biased, clamped variants
            for kernel in ("gate_up", "down_sum"):
                assert "cp.async" in ptx[f"{kernel} {weight} {suffix}"], (kernel, suffix)
        assert "ld.global" not in ptx[f"down_sum {weight}"]


def test_block_scaled_decode_copies_what_per_channel_does(ptx) -> None:
    """Block scales loaded once a row and 128 inputs: the block-scaled GEMVs' async copies are
    per-channel float8's plus a [BLOCK_N, BLOCK_K / 128] scale tile (gate's and up's) a stage.
    A scale gathered per weight, staged 4 bytes a code (hundreds of copies), ran 15x slower."""
    for kernel in ("gate_up", "down_sum", "down"):
        channel = len(_ASYNC_COPY.findall(ptx[f"{kernel} fp8e4nv"]))
        block = len(_ASYNC_COPY.findall(ptx[f"{kernel} fp8_block"]))
        assert channel <= block <= channel + 2 * 3, (kernel, channel, block)  # 3 stages


def test_the_fp8_grouped_gemm_runs_on_the_float8_tensor_cores(ptx) -> None:
    for name, tma in (("tma=0", False), ("tma=1", True), ("large", False)):
        code = ptx[f"fp8 gemm {name}"]
        assert "wgmma.mma_async" in code and ".e4m3.e4m3" in code  # float8 x float8 MMAs
        assert ("cp.async.bulk.tensor" in code) == tma  # TMA loads only where asked


@pytest.mark.parametrize("name", ["int4 gemm", "int8 gemm", "int8 g128 gemm"])
def test_the_integer_grouped_gemms_dequantize_onto_the_bf16_tensor_cores(ptx, name) -> None:
    assert "wgmma.mma_async" in ptx[name] and ".bf16.bf16" in ptx[name]


def test_the_router_compiles_to_warp_shuffles(ptx) -> None:
    assert ".entry _route_kernel" in ptx["router"]
    assert "bar.sync" not in ptx["router"]  # one warp: no barrier between its reductions
    # The sigmoid variant (DeepSeek-V3's 256 experts in 8 groups) stays one warp's shuffles.
    assert "ex2.approx" in ptx["sigmoid router"] and "bar.sync" not in ptx["sigmoid router"]


if __name__ == "__main__":
    json.dump(_compile_all(), sys.stdout)
