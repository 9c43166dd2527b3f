"""Multi-head latent attention's kernels compiled for an H100 (sm_90) on the CPU, as a GPU run
would JIT them, at DeepSeek's real row (64 rotary + 512 latent dims, bf16): the MLA decode
kernel, the shared decode's merge (which merges its partitions), and the shared prefill and
decode kernels at the tiles a GPU takes for a 576-wide head (16 query heads a KV head:
V2-Lite's, V3's per rank at TP=8). Each must fit an H100's 227 KiB of shared memory (the shared
kernels' usual tiles need 262 KiB and more at this width); the MLA decode's dots run on the
tensor cores. Compiles only, in a subprocess without
TRITON_INTERPRET; never run or timed on a GPU here."""

from __future__ import annotations

import json
import sys

import pytest

from tests.kernels.sm90_compile import compiled_in_subprocess

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")
pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")

H100_SHARED_BYTES = 227 * 1024


def _compile(fn, signature: dict, constants: dict, num_warps: int, num_stages: int) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=fn, signature=signature, constexprs=constants, attrs={})
    options = {"num_warps": num_warps, "num_stages": num_stages}
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    return {"shared": kernel.metadata.shared, "mma": "mma" in kernel.asm["ptx"]}


def _compile_all() -> dict[str, dict]:
    import torch

    from kiln.kernels.triton import decode_attention, mla_decode, prefill_attention

    cuda, out = torch.device("cuda"), {}
    mla_args = {
        "q_ptr": "*bf16", "cache_ptr": "*bf16", "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "out_ptr": "*bf16", "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "scale_log2": "fp32", "stride_q_seq": "i32",
        "stride_q_head": "i32", "stride_bt_seq": "i32", "stride_o_seq": "i32",
        "stride_o_head": "i32", "num_heads": "i32", "num_splits": "i32",
    }  # fmt: skip
    for split in (False, True):
        out[f"mla decode split={split}"] = _compile(
            mla_decode._mla_decode_kernel, mla_args,
            {"ROPE": 64, "LORA": 512, "ROPE_PAD": 64, "LORA_PAD": 512, "BLOCK_SIZE": 16,
             "BLOCK_H": 16, "BLOCK_N": 32, "SPLIT": split, "DOT_PRECISION": "tf32"},
            4, 2,
        )  # fmt: skip
    out["shared merge"] = _compile(  # the MLA decode's partitions merged, 512 latent dims wide
        decode_attention._decode_reduce_kernel,
        {"part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*bf16",
         "stride_o_seq": "i32", "stride_o_head": "i32", "num_splits": "i32"},
        {"NUM_HEADS": 16, "HEAD_DIM": 512, "BLOCK_D": 512, "SPLITS_PAD": 32}, 4, 1,
    )  # fmt: skip
    shared = {"NUM_KV_HEADS": 1, "HEAD_DIM": 576, "BLOCK_D": 1024, "BLOCK_SIZE": 16,
              "DOT_PRECISION": "tf32", "FP16_DOTS": False, "SLIDING": False, "SOFTCAP": False,
              "SINKS": False}  # fmt: skip
    block_m, block_n, warps, stages = prefill_attention._tile_config(576, 4096, 16, 1, cuda)
    prefill = prefill_attention._prefill_kernel
    out["shared prefill"] = _compile(
        prefill,
        {name: ("*i32" if name in ("block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr")
                else "*bf16" if name.endswith("_ptr")
                else "fp32" if name in ("qk_scale", "softcap_in", "softcap_out") else "i32")
         for name in prefill.arg_names[:17]},
        {**shared, "GROUP": 16, "BLOCK_M": block_m, "BLOCK_N": block_n, "FP8_QK": False,
         "INTERPRETED": False},
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


def test_every_kernel_fits_an_h100s_shared_memory(compiled) -> None:
    assert set(compiled) == {"mla decode split=False", "mla decode split=True", "shared merge",
                             "shared prefill", "shared decode"}  # fmt: skip
    for name, kernel in compiled.items():
        assert kernel["shared"] <= H100_SHARED_BYTES, (name, kernel["shared"])


def test_the_mla_decode_dots_run_on_the_tensor_cores(compiled) -> None:
    assert compiled["mla decode split=False"]["mma"] and compiled["mla decode split=True"]["mma"]


if __name__ == "__main__":
    json.dump(_compile_all(), sys.stdout)
