"""The packed decode attention kernel over a float8 cache compiled for an H100 (sm_90) on the CPU,
as a GPU run would JIT it, at Gemma-2-9B's rows (16 query heads on 8 KV heads of 256 dims, logit
soft-cap, sliding window on alternate layers): at the tiles decode_attention chooses for rows of
256 dims, ptxas spills nothing and two programs fit an SM's shared memory (head_dim 128's tiles
spilled at 256 and took 153 KiB, one program an SM). Compiles only, in a subprocess without
TRITON_INTERPRET; the numbers come from benchmarks/kernels_gpu.py --only decode256."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from tests.kernels.sm90_compile import compiled_in_subprocess, ptxas_report, spilled_bytes

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")
pytest.importorskip("triton.backends.nvidia", reason="triton without its NVIDIA backend")

from kiln.kernels.triton import decode_attention

H100_SHARED_BYTES = 227 * 1024
# Gemma-2-9B's global and sliding layers (both soft-capped).
_CASES = {"softcap": False, "softcap+window": True}


def _compile(sliding: bool) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kiln.kernels.triton import decode_attention_packed

    block_n, warps, stages = decode_attention._WIDE_PACKED_TILE
    fn = decode_attention_packed._decode_packed_kernel
    pointers = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
                "block_tables_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
                "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32"}  # fmt: skip
    # The launch's strides (16 x 256, 256; a 512-block table row) divide by 16; one split.
    aligned = (*pointers, "stride_q_seq", "stride_q_head", "stride_o_seq", "stride_o_head",
               "stride_bt_seq")  # fmt: skip
    signature = {**pointers, "qk_scale": "fp32", **dict.fromkeys(aligned[8:], "i32"),
                 "window": "i32", "softcap_in": "fp32", "softcap_out": "fp32"}  # fmt: skip
    constants = {"num_splits": 1, "NUM_KV_HEADS": 8, "GROUP": 2,
                 "PACK": decode_attention_packed.packing(2, 256), "HEAD_DIM": 256,
                 "BLOCK_SIZE": 16, "BLOCK_N": block_n, "SPLIT": False, "DOT_PRECISION": "tf32",
                 "FP16_DOTS": True, "SLIDING": sliding, "SOFTCAP": True}  # fmt: skip
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = ASTSource(fn=fn, signature={**signature, **dict.fromkeys(constants, "constexpr")},
                       constexprs=constants, attrs=attrs)  # fmt: skip
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps, "num_stages": stages})  # fmt: skip
    ptx = kernel.asm["ptx"]
    return {"shared": kernel.metadata.shared, "spilled": spilled_bytes(ptxas_report(ptx)),
            "mma": "mma.sync" in ptx}  # fmt: skip


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    return compiled_in_subprocess(__file__)


@pytest.mark.parametrize("case", list(_CASES))
def test_head_dim_256_float8_decode_does_not_spill(compiled, case: str) -> None:
    got = compiled[case]
    assert got["mma"], case
    assert got["spilled"] == [0, 0], (case, got)
    # Two programs an SM: the same share of shared memory as head_dim 128's tiles.
    assert 2 * got["shared"] <= H100_SHARED_BYTES, (case, got["shared"])


def test_only_wide_rows_take_the_wide_packed_tile(monkeypatch) -> None:
    """Rows of 256 dims take one tile at every grid size; head_dim 128's choices stay as
    measured (one warp of 16 past 12 programs an SM, two of 32 past 2, four of 16 below)."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(decode_attention, "num_sms", lambda device: 132)
    for programs in (8, 256, 264, 1416, 1584, 6144):
        wide = decode_attention._packed_tile_config(16, cuda, programs, head_dim=256)
        assert wide == decode_attention._WIDE_PACKED_TILE == (16, 4, 2)
        narrow = decode_attention._packed_tile_config(16, cuda, programs, head_dim=128)
        expected = (16, 1, 2) if programs >= 1584 else (32, 2, 2) if programs >= 264 else (16, 4, 2)
        assert narrow == expected, programs
        assert decode_attention._packed_tile_config(16, cuda, programs) == narrow


if __name__ == "__main__":
    json.dump({case: _compile(sliding) for case, sliding in _CASES.items()}, sys.stdout)
