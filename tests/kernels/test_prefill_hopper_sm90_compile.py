"""The Gluon prefill attention kernel (kiln.kernels.triton.prefill_attention_hopper) compiled for
an H100 (sm_90) on the CPU, as a GPU run would JIT it: its MMAs are warpgroup MMAs, its K/V tiles
arrive by TMA (one copy a page piece and 128 bytes of columns, all on one mbarrier expecting the
tile's bytes), its partitions split the registers, and ptxas spills (next to) nothing; bf16 and
float8 caches. Compiles only, in a subprocess without TRITON_INTERPRET; its host-side logic
(descriptors, grid, selection) runs here. The numbers come from benchmarks/kernels_gpu.py
--long, the values from tests/kernels/test_prefill_attention_hopper.py on a GPU."""

from __future__ import annotations

import json
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

from kiln.kernels.kv_layout import empty_cache
from kiln.kernels.triton import prefill_attention_hopper as hopper

# (block size, attention partitions, cache): eight page pieces a key tile or one; two attention
# warpgroups as partitions of their own (the default) or as one partition; a bf16 cache, or a
# float8 one with float8 Q @ K^T.
_CASES = ((16, 2, "bf16"), (128, 2, "bf16"), (16, 1, "bf16"), (16, 2, "fp8"), (16, 1, "fp8"))


class _Shape:
    """What launch_config reads of a tensor: its shape."""

    def __init__(self, *shape: int) -> None:
        self.shape = shape


def _compile(block_size: int, consumers: int, cache: str) -> dict[str, str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.experimental.gluon._runtime import GluonASTSource

    # Llama-3.1-8B's attention: 32 query heads on 8 KV heads of 128.
    hopper.CONSUMERS = consumers
    size = 1 if cache == "fp8" else 2
    k_cache = torch.empty(1, block_size, 8, 128, dtype=torch.float8_e4m3fn if size == 1 else
                          torch.bfloat16)  # fmt: skip
    _, meta = hopper.launch_config(_Shape(1, 32, 128), k_cache, 1, 1)
    num_warps = meta.pop("num_warps")
    box = f"[{hopper.piece_rows(block_size)}, {128 // size}]"
    desc = f"tensordesc<{'fp8e4nv' if size == 1 else 'bf16'}{box},{hopper.chunk_layout(size)!r}>"
    signature = {
        "q_ptr": "*bf16", "k_desc": desc, "v_desc": desc, "block_tables_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": "*bf16",
        "qk_scale": "fp32", "oob_row": "i32", "stride_q_token": "i32", "stride_q_head": "i32",
        "stride_o_token": "i32", "stride_o_head": "i32", "stride_bt_seq": "i32",
        **dict.fromkeys(meta, "constexpr"),
    }  # fmt: skip
    source = GluonASTSource(fn=hopper._prefill_kernel, signature=signature, constexprs=meta)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps})  # fmt: skip
    ptx = compiled.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        ptxas = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(path), "-o",
                                str(Path(tmp) / "kernel.cubin")],
                               capture_output=True, text=True, check=True)  # fmt: skip
    return {"ptx": ptx, "ptxas": ptxas.stdout + ptxas.stderr, "triton": triton.__version__}


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict[str, str]]:
    return compiled_in_subprocess(__file__)


def _case(compiled: dict, block_size: int, consumers: int, cache: str) -> dict[str, str]:
    return compiled[f"{block_size} {consumers} {cache}"]


@pytest.mark.parametrize(("block_size", "consumers", "cache"), _CASES)
def test_the_matmuls_are_warpgroup_mmas(
    compiled, block_size: int, consumers: int, cache: str
) -> None:
    ptx = _case(compiled, block_size, consumers, cache)["ptx"]
    # Q @ K^T and P @ V: 128 / 16 instructions each (128 / 32 for float8 Q @ K^T), in the loop
    # and outside it (tile 0's scores, the last tile's P @ V), in each attention partition's
    # code; P from registers.
    pv = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k16\.f32\.bf16\.bf16", ptx)
    qk = re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx)
    if cache == "fp8":
        assert (len(qk), len(pv)) == (consumers * 2 * 4, consumers * 2 * 8)
    else:
        assert (len(qk), len(pv)) == (0, consumers * 2 * 2 * 8)
    assert "wgmma.wait_group.sync.aligned 1;" in ptx  # S_t waited for while P @ V runs


@pytest.mark.parametrize(("block_size", "consumers", "cache"), _CASES)
def test_key_tiles_arrive_by_tma_one_copy_a_page_piece(
    compiled, block_size: int, consumers: int, cache: str
) -> None:
    ptx = _case(compiled, block_size, consumers, cache)["ptx"]
    pieces = 128 // hopper.piece_rows(block_size)
    chunks = 1 if cache == "fp8" else 2  # 128-byte column boxes a 128-wide row
    # shared::cluster (Triton 3.6) or shared::cta (later) destinations alike.
    copies = re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::\w+\.global\.mbarrier", ptx)
    assert len(copies) == 2 * pieces * chunks  # K's and V's
    # One expectation a tile, the whole tile's bytes: 128 keys x 128 dims.
    expects = re.findall(
        r"mbarrier\.arrive\.expect_tx\.shared(?:::cta)?\.b64 _, \[%r\d+\], (\d+);", ptx
    )
    assert expects == [str(128 * 128 * chunks)] * 2  # K's, V's: chunks = element bytes
    assert "mbarrier.try_wait.parity" in ptx


@pytest.mark.parametrize(("block_size", "consumers", "cache"), _CASES)
def test_the_partitions_split_the_registers_without_spilling(
    compiled, block_size: int, consumers: int, cache: str
) -> None:
    case = _case(compiled, block_size, consumers, cache)
    ptx, ptxas = case["ptx"], case["ptxas"]
    # Two attention warpgroups and the load warp's warpgroup (FA3's register split); Triton
    # gives the default partition what the workers leave.
    assert ".reqntid 384" in ptx
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{hopper.LOAD_REGS};" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
    # Triton 3.6 (ptxas 12.8) spills nothing; 3.9 (ptxas 13.4) 36 bytes, a handful of scalars.
    spilled = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", ptxas)
    assert spilled is not None and int(spilled[1]) <= 64 and int(spilled[2]) <= 64, ptxas


def test_the_descriptor_rows_are_page_pieces_of_one_kv_head() -> None:
    """Row (block * num_kv_heads + kv_head) * block_size + slot of the descriptor's view is the
    cache's [block, slot, kv_head]: the row _piece_row computes."""
    num_blocks, block_size, num_kv_heads = 5, 16, 3
    cache = empty_cache(num_blocks, block_size, num_kv_heads, 128, torch.bfloat16,
                        torch.device("cpu"))  # fmt: skip
    cache.copy_(torch.randn(cache.shape))
    desc = hopper.cache_descriptor(cache)
    assert list(desc.shape) == [num_blocks * num_kv_heads * block_size, 128]
    assert list(desc.strides) == [128, 1] and list(desc.block_shape) == [16, 64]
    assert desc.base.data_ptr() == cache.data_ptr()
    rows = desc.base
    for block, slot, head in ((0, 0, 0), (3, 7, 2), (4, 15, 1), (2, 9, 0)):
        assert torch.equal(rows[(block * num_kv_heads + head) * block_size + slot],
                           cache[block, slot, head])  # fmt: skip
    big = empty_cache(2, 256, 2, 128, torch.bfloat16, torch.device("cpu"))
    assert list(hopper.cache_descriptor(big).block_shape) == [128, 64]  # one copy a tile


def test_the_grid_puts_a_kv_heads_query_heads_side_by_side() -> None:
    k_cache = torch.empty(4, 16, 8, 128, dtype=torch.bfloat16)
    grid, meta = hopper.launch_config(_Shape(9, 32, 128), k_cache, 300, 3)
    assert grid == (32, 3, 3)  # heads fastest; ceil(300 / 128) query tiles; sequences
    assert meta["GROUP"] == 4 and meta["ROWS"] == 16 and not meta["FP8_QK"]
    # A warpgroup an attention partition: two of them, or one of two warpgroups.
    assert (meta["CONSUMERS"], meta["num_warps"]) == (hopper.CONSUMERS, 8 // hopper.CONSUMERS)


def test_support_is_sm90_head_dim_128_plain_causal_only() -> None:
    query = torch.zeros(4, 32, 128, dtype=torch.bfloat16)
    cache = empty_cache(2, 16, 8, 128, torch.bfloat16, torch.device("cpu"))
    assert not hopper.supports(query, cache) and not hopper.applies(query, cache)  # no GPU
    if torch.cuda.is_available():
        gpu_query, gpu_cache = query.cuda(), cache.cuda()
        sm90 = torch.cuda.get_device_capability() == (9, 0)
        assert hopper.supports(gpu_query, gpu_cache) == sm90
        assert not hopper.supports(gpu_query, gpu_cache, window=64)
        assert not hopper.supports(gpu_query, gpu_cache, softcap=30.0)
        assert not hopper.supports(gpu_query.half(), gpu_cache.half())
        fp8_cache = gpu_cache.to(torch.float8_e4m3fn)
        assert hopper.supports(gpu_query, fp8_cache, fp8_qk=True) == sm90
        assert not hopper.supports(gpu_query, fp8_cache)  # widened float8: the Triton kernel's
        small_blocks = empty_cache(4, 8, 8, 128, torch.bfloat16, gpu_query.device)
        assert not hopper.supports(gpu_query, small_blocks)  # a TMA box of 8 rows: not tried
        assert not hopper.supports(gpu_query[..., :64], gpu_cache[..., :64])
        for cache_ in (gpu_cache, fp8_cache):  # selected: supported and not deselected
            fp8_qk = cache_ is fp8_cache
            selected = hopper.supports(gpu_query, cache_, fp8_qk=fp8_qk) and (
                cache_.dtype in hopper.SELECTED
            )
            assert hopper.applies(gpu_query, cache_, fp8_qk=fp8_qk) == selected


if __name__ == "__main__":
    json.dump({" ".join(map(str, case)): _compile(*case) for case in _CASES}, sys.stdout)
