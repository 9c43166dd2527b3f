"""Every Triton kernel against its pure-PyTorch twin in kiln.kernels.reference (the oracle).

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set before triton is
imported) on CPU tensors, at tiny shapes, in fp32 and fp16 (the interpreter mis-computes bf16 dots).
With CUDA the same tests run on the GPU, plus bf16 and Llama-3.1-8B-sized shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.attention.backend import AttentionMetadata, get_attention_backend
from kiln.attention.torch_backend import TorchAttentionBackend, run_split_attention
from kiln.attention.triton_backend import TritonAttentionBackend
from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton import decode_attention
from kiln.kernels.triton.decode_attention import (
    choose_num_splits,
    paged_decode_attention_splits,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
on_gpu = pytest.mark.skipif(INTERPRET, reason="needs a CUDA GPU (interpreter run)")

# bf16 only compiled: the interpreter gets bf16 dot products and additions wrong.
DTYPES = [
    torch.float32,
    torch.float16,
    pytest.param(torch.bfloat16, marks=on_gpu),
]
# Tolerances of the attention kernels against the fp32 reference on the same (rounded) inputs.
ATTN_ATOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# Float8 Q.K dots on a GPU: Hopper's float8 tensor cores accumulate in fewer bits than the twin's
# fp32 (an H100 measured 2.3e-4 against the twin where the interpreter agrees to 3e-7).
FP8_QK_GPU_ATOL = 1e-3


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    """The same values at the same [block, slot, head, dim] indices, laid out head-major in
    memory as the kernels require (kiln.kernels.kv_layout)."""
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def _paged_cache(
    seq_lens: list[int],
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    extra_blocks: int = 3,
    cache_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random head-major caches (unused slots hold random values too) and shuffled block tables;
    the caches are `cache_dtype` (e.g. float8) when given, else `dtype`."""
    blocks_per_seq = [_cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + extra_blocks
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = _head_major(torch.randn(shape, generator=gen).to(cache_dtype or dtype))
    v_cache = _head_major(torch.randn(shape, generator=gen).to(cache_dtype or dtype))
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[used : used + n].int()
        used += n
    return k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE)


def _slots(block_tables: torch.Tensor, seq: int, positions: range, block_size: int) -> list[int]:
    table = block_tables[seq].tolist()
    return [table[p // block_size] * block_size + p % block_size for p in positions]


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=atol)


# ---------------------------------------------------------------------------------------------
# Caches: float8 bytes and the rounding the written values may show


FP8 = torch.float8_e4m3fn


def _bits(cache: torch.Tensor) -> torch.Tensor:
    """A cache's raw bytes (torch.equal has no float8 kernel on the CPU)."""
    return cache.view(torch.uint8) if cache.element_size() == 1 else cache


def _assert_same_cache(cache: torch.Tensor, expected: torch.Tensor, rotated: bool = False) -> None:
    """Bit-equal caches; or, for keys the kernel rotated itself, within one step of the cache's
    element type: the GPU contracts the rotation into FMAs (last-bit differences in fp32, which
    can move a rounding to a narrower cache type by one step). Triton 3.x's interpreter rounds
    fp32 to float8 wrongly when the rounding carries into the next power of two (-125.7 gives -64,
    not -128; the GPU's conversion is right) and by a step among subnormals, so there float8
    caches are compared with the same tolerance, also accepting half of an expected power of
    two; on the GPU unrotated values are exact."""
    if not rotated and not (INTERPRET and cache.dtype == FP8):
        assert torch.equal(_bits(cache), _bits(expected))
        return
    a, b = cache.float(), expected.float()
    step = {torch.float32: 1e-6, torch.float16: 2**-10, torch.bfloat16: 2**-7, FP8: 2**-3}
    tol = step[cache.dtype] * b.abs() + (2**-9 if cache.dtype == FP8 else 1e-6)  # + subnormals
    ok = (a - b).abs() <= tol
    if INTERPRET and cache.dtype == FP8:
        power_of_two = (b != 0) & (torch.log2(b.abs()) == torch.log2(b.abs()).round())
        ok |= (2 * a == b) & power_of_two
    assert ok.all(), list(zip(a[~ok].tolist()[:8], b[~ok].tolist()[:8]))


# ---------------------------------------------------------------------------------------------
# Decode attention


def _check_decode(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = _paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, cache_dtype=cache_dtype
    )
    query = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    max_seq_len = max(seq_lens)
    if num_splits is None:
        out = triton_ops.paged_decode_attention(
            query, k_cache, v_cache, block_tables, lens, scale, max_seq_len
        )
    else:
        out = paged_decode_attention_splits(
            query, k_cache, v_cache, block_tables, lens, scale, max_seq_len, num_splits
        )
    expected = reference.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), block_tables, lens, scale, max_seq_len
    )
    assert out.dtype == dtype and out.shape == query.shape
    _assert_close(out, expected, ATTN_ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 4), (2, 2, 32, 16)],
)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["nosplit", "split3", "auto"])
def test_decode_attention(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_splits: int | None,
) -> None:
    # Contexts of one token, mid-block ends, many blocks; with 3 splits of the longest context
    # (and with the policy's choice, 3 as well) the short sequences have empty partitions.
    _check_decode([1, 13, 137], num_heads, num_kv_heads, head_dim, block_size, dtype, num_splits)


def _packs(monkeypatch, packed: bool) -> None:
    """Decode over a float8 cache runs the packed kernel where the group packs (every group
    here does); not `packed`, the unpacked kernel, which runs the groups it cannot pack."""
    if not packed:
        monkeypatch.setattr(decode_attention, "packing", lambda group, head_dim: 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_decode_attention_fp8_cache(
    monkeypatch, dtype: torch.dtype, num_splits: int, packed: bool
) -> None:
    # Keys/values stored as float8 e4m3, read and widened to the query's dtype in the kernel; the
    # reference attends in fp32 over the same float8 values. Both kernels: the packed one (where
    # the group packs) and the unpacked one (groups it cannot pack).
    _packs(monkeypatch, packed)
    _check_decode([1, 13, 137], 4, 2, 16, 4, dtype, num_splits, cache_dtype=FP8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "block_size"),
    [(8, 2, 4), (8, 2, 16), (4, 2, 16), (16, 2, 32)],
    ids=["group4-block4", "group4-block16", "group2", "group8"],
)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["nosplit", "split3", "auto"])
def test_decode_attention_packed(
    monkeypatch, dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int,
    num_splits,
) -> None:  # fmt: skip
    # decode_attention_packed's kernel (a program's keys in 16 / group sub-partitions side by side
    # in tl.dot's rows) over a float8 cache: sub-tiles inside one block (a scalar block id) and
    # across blocks (a gather), sub-partitions that end early or hold no key, merged per head.
    from kiln.kernels.triton import decode_attention_packed

    assert decode_attention_packed.packing(num_heads // num_kv_heads, 16) == 16 // (
        num_heads // num_kv_heads
    )
    calls = []
    kernel = decode_attention._decode_packed_kernel
    monkeypatch.setattr(
        decode_attention, "_decode_packed_kernel", _Recording(kernel, calls), raising=True
    )
    for seq_lens in ([1, 13, 137], [5, 70, 64]):
        _check_decode(
            seq_lens, num_heads, num_kv_heads, 16, block_size, dtype, num_splits,
            cache_dtype=FP8,
        )  # fmt: skip
    assert calls, "the packed kernel did not run"


@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
def test_decode_attention_packed_head_dim_256(monkeypatch, num_splits: int) -> None:
    # Gemma-2's rows (a group of 2, 256 dims) through the packed kernel over a float8 cache: the
    # width decode_attention gives tiles of its own on a GPU (16-key sub-tiles, as here).
    calls = []
    kernel = decode_attention._decode_packed_kernel
    monkeypatch.setattr(
        decode_attention, "_decode_packed_kernel", _Recording(kernel, calls), raising=True
    )
    _check_decode([5, 37], 4, 2, 256, 16, torch.float16, num_splits, cache_dtype=FP8)
    assert calls, "the packed kernel did not run"


class _Recording:
    """Stands in for a @triton.jit kernel and notes each launch's grid."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def _decode_inputs(
    seq_lens: list[int], dtype: torch.dtype, cache_dtype, seed: int, num_kv_heads: int = 2
):
    """(query, k_cache, v_cache, block_tables, lens, scale): 4 query heads, head_dim 16."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = _paged_cache(
        seq_lens, 4, num_kv_heads, 16, dtype, gen, cache_dtype=cache_dtype
    )
    query = torch.randn(len(seq_lens), 4, 16, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query, k_cache, v_cache, block_tables, lens, 16**-0.5


def _reference_decode(query, k_cache, v_cache, block_tables, lens, scale) -> torch.Tensor:
    return reference.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), block_tables, lens, scale,
        int(lens.max()),
    )  # fmt: skip


# fp32 and fp16, and a float8 cache through the unpacked kernel's V-prefetch loop.
GRID_CASES = [
    pytest.param(torch.float32, None, id="fp32"),
    pytest.param(torch.float16, None, id="fp16"),
    pytest.param(torch.float16, FP8, id="fp16-fp8cache"),
]
PACKED_FP8 = "packed-fp8"  # a float8 cache through decode_attention_packed's kernel
PACKED_CASES = [pytest.param(torch.float16, PACKED_FP8, id="fp16-fp8cache-packed")]


@pytest.mark.parametrize(("dtype", "cache_dtype"), GRID_CASES + PACKED_CASES)
def test_decode_attention_graph_grid_mixed_lengths(
    dtype: torch.dtype, cache_dtype, monkeypatch
) -> None:
    # What a graph replay does: the launcher is given its bucket's max_seq_len (far above every
    # context here) with the split count chosen for that bucket. Each sequence must still cut
    # its own context into partitions of that count (a 1-token, a 3-tile and an 8-tile context
    # in one batch), so the replay computes bit for bit what an eager step with the same count
    # computes, batched or alone, and matches the reference.
    _packs(monkeypatch, cache_dtype == PACKED_FP8)
    cache_dtype = FP8 if cache_dtype == PACKED_FP8 else cache_dtype
    seq_lens, bucket, num_splits = [1, 45, 120], 131072, 5
    query, k_cache, v_cache, tables, lens, scale = _decode_inputs(seq_lens, dtype, cache_dtype, 5)
    args = (query, k_cache, v_cache, tables, lens, scale)
    replay = paged_decode_attention_splits(*args, bucket, num_splits)
    assert torch.equal(replay, paged_decode_attention_splits(*args, max(seq_lens), num_splits))
    alone = paged_decode_attention_splits(
        query[1:2], k_cache, v_cache, tables[1:2], lens[1:2], scale, seq_lens[1], num_splits
    )
    assert torch.equal(alone[0], replay[1])
    _assert_close(replay, _reference_decode(*args), ATTN_ATOL[dtype])


@pytest.mark.parametrize(("dtype", "cache_dtype"), GRID_CASES + PACKED_CASES)
def test_decode_attention_idle_splits_hold_stale_values(
    dtype: torch.dtype, cache_dtype, monkeypatch
) -> None:
    # A graph's split buffers keep what earlier steps wrote (here: a log-sum-exp above any real
    # one and NaN outputs). A split past a short sequence's last partition must overwrite its
    # log-sum-exp with -inf, so the reduce (which reads no seq_lens) gives it weight 0.
    _packs(monkeypatch, cache_dtype == PACKED_FP8)
    cache_dtype = FP8 if cache_dtype == PACKED_FP8 else cache_dtype
    split_buffers = decode_attention._split_buffers

    def stale(query, num_splits):
        part_out, part_lse = split_buffers(query, num_splits)
        return part_out.fill_(float("nan")), part_lse.fill_(1000.0)

    monkeypatch.setattr(decode_attention, "_split_buffers", stale)
    seq_lens, num_splits = [1, 45, 120], 5
    query, k_cache, v_cache, tables, lens, scale = _decode_inputs(seq_lens, dtype, cache_dtype, 7)
    args = (query, k_cache, v_cache, tables, lens, scale)
    out = paged_decode_attention_splits(*args, 131072, num_splits)
    assert not out.isnan().any()
    _assert_close(out, _reference_decode(*args), ATTN_ATOL[dtype])


@pytest.mark.parametrize(("dtype", "cache_dtype"), GRID_CASES)
def test_decode_attention_more_splits_than_tiles(dtype: torch.dtype, cache_dtype) -> None:
    # The policy's split count for batch 2 at a 128k bucket (64) against contexts of 1 and 3
    # tiles (16 keys a tile in the interpreter): most of each sequence's splits are past its
    # last partition and exit; the reduce merges only the ones written.
    seq_lens = [5, 40]
    query, k_cache, v_cache, tables, lens, scale = _decode_inputs(
        seq_lens, dtype, cache_dtype, 6, num_kv_heads=1
    )
    assert choose_num_splits(len(seq_lens), 1, 131072, 132) == 64
    out = triton_ops.paged_decode_attention(query, k_cache, v_cache, tables, lens, scale, 131072)
    assert out.dtype == dtype
    _assert_close(
        out, _reference_decode(query, k_cache, v_cache, tables, lens, scale), ATTN_ATOL[dtype]
    )


def test_kernels_refuse_a_cache_that_is_not_head_major() -> None:
    # A token's heads together (a plain contiguous tensor), or a slice of the heads, would be
    # read and written at the wrong offsets: every kernel that takes a cache refuses it.
    query, k_cache, v_cache, tables, lens, scale = _decode_inputs([13, 40], torch.float32, None, 3)
    token_major = k_cache.contiguous()
    for k, v in ((token_major, v_cache), (k_cache, token_major), (k_cache[:, :, :1], v_cache)):
        with pytest.raises(ValueError, match="head-major"):
            paged_decode_attention_splits(query, k, v, tables, lens, scale, 40, 1)
    starts = torch.tensor([0, 1, 2], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head-major"):
        triton_ops.paged_prefill_attention(
            query, token_major, v_cache, tables, starts, lens, scale, 1, 40
        )
    key = torch.zeros(2, 2, 16, device=DEVICE)
    cos_sin = _cos_sin_cache(64, 16).to(DEVICE)
    positions = slots = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="head-major"):
        triton_ops.rotary_embedding_write_kv(
            positions, query[:2], key, key, cos_sin, k_cache, token_major, slots
        )
    with pytest.raises(ValueError, match="head-major"):
        triton_ops.copy_kv_blocks([token_major], torch.tensor([[0, 1]], device=DEVICE))


def test_choose_num_splits() -> None:
    # A full batch keeps the GPU busy on its own: no split.
    assert choose_num_splits(128, 8, 4096, 132) == 1
    assert choose_num_splits(64, 8, 2048, 132) == 1
    # Up to ~4 programs per SM, never past it.
    assert choose_num_splits(32, 8, 4096, 132) == 2
    assert choose_num_splits(16, 8, 4096, 132) == 4
    # Batch 1: as many as allowed, but no partition under 64 tokens.
    assert choose_num_splits(1, 8, 4096, 132) == 64
    assert choose_num_splits(1, 8, 1024, 132) == 16
    assert choose_num_splits(1, 8, 64, 132) == 1
    # Past one wave of programs, long contexts split until the last wave is >= 90% full: 84 x 8
    # programs at 21k fill 1.27 waves of 528, cut in 3 they fill 95% of 4; 64 x 8 fill one wave
    # already; short contexts never split there (partitions of >= 1024 keys).
    assert choose_num_splits(84, 8, 22000, 132) == 3
    assert choose_num_splits(64, 8, 131072, 132) == 1
    assert choose_num_splits(72, 8, 131072, 132) == 5
    assert choose_num_splits(84, 8, 2047, 132) == 1
    assert choose_num_splits(84, 8, 2048, 132) == 2  # capped by the partition length
    # Never falls as the context grows (decode graphs rely on it).
    for batch in (67, 84, 100, 137, 200):
        counts = [choose_num_splits(batch, 8, n, 132) for n in range(256, 140000, 997)]
        assert counts == sorted(counts), batch


@on_gpu
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("batch", [1, 7, 64])
def test_decode_attention_llama8b_bf16(block_size: int, batch: int) -> None:
    gen = torch.Generator().manual_seed(batch)
    seq_lens = torch.randint(1, 4097, (batch,), generator=gen).tolist()
    seq_lens[0] = 4096
    _check_decode(seq_lens, 32, 8, 128, block_size, torch.bfloat16, None, seed=batch)


# ---------------------------------------------------------------------------------------------
# Prefill attention


def _check_prefill(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    cache_dtype: torch.dtype | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = _paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, cache_dtype=cache_dtype
    )
    num_tokens = sum(q_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    query_start_loc = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    args = (block_tables, query_start_loc, lens, scale, max(q_lens), max(seq_lens))
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, *args)
    expected = reference.paged_prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), *args
    )
    assert out.dtype == dtype and out.shape == query.shape
    _assert_close(out, expected, ATTN_ATOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 2, 16, 4), (2, 2, 32, 16)],
)
def test_prefill_attention(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    # A whole prompt over two query tiles; a chunk after a cached prefix ending mid-block;
    # a single-token chunk; a chunk whose prefix is not a multiple of the key tile.
    _check_prefill(
        q_lens=[21, 9, 1, 6],
        seq_lens=[21, 30, 11, 23],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_fp8_cache(dtype: torch.dtype) -> None:
    _check_prefill([21, 9, 1, 6], [21, 30, 11, 23], 4, 2, 16, 4, dtype, cache_dtype=FP8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_fp8_qk(dtype: torch.dtype) -> None:
    # Float8 Q.K dots: the twin quantizes Q as the kernel does, so they agree as tightly as the
    # widened path does with its twin (bf16: its query rounding).
    gen = torch.Generator().manual_seed(11)
    q_lens, seq_lens = [21, 9, 1, 37], [21, 30, 11, 60]
    # head_dim 32: float8 tensor-core dots reduce over at least 32 (reference.uses_fp8_qk).
    k_cache, v_cache, tables = _paged_cache(seq_lens, 4, 2, 32, dtype, gen, cache_dtype=FP8)
    query = torch.randn(sum(q_lens), 4, 32, generator=gen).to(DEVICE, dtype)
    starts = torch.tensor([0, 21, 30, 31, 68], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (tables, starts, lens, 0.25, max(q_lens), max(seq_lens))
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, *args, fp8_qk=True)
    twin = reference.paged_prefill_attention(query.float(), k_cache, v_cache, *args, fp8_qk=True)
    _assert_close(
        out, twin, ATTN_ATOL[dtype] if INTERPRET else max(ATTN_ATOL[dtype], FP8_QK_GPU_ATOL)
    )
    widened = reference.paged_prefill_attention(query.float(), k_cache, v_cache, *args)
    assert (twin - widened).abs().max() > 1e-3  # the float8 rounding is there
    # A bf16 or fp16 cache ignores the option: the kernel it always ran.
    cache16 = k_cache.to(torch.float16), v_cache.to(torch.float16)
    if dtype == torch.float16:
        plain = triton_ops.paged_prefill_attention(query, *cache16, *args)
        assert torch.equal(
            triton_ops.paged_prefill_attention(query, *cache16, *args, fp8_qk=True), plain
        )


def test_prefill_fp8_qk_needs_head_dim_32() -> None:
    # Heads under 32 dims widen K and V as before (a float8 MMA reduces over >= 32), in both
    # twins alike.
    gen = torch.Generator().manual_seed(13)
    k_cache, v_cache, tables = _paged_cache([20], 4, 2, 16, torch.float32, gen, cache_dtype=FP8)
    query = torch.randn(20, 4, 16, generator=gen).to(DEVICE)
    args = (tables, torch.tensor([0, 20], dtype=torch.int32, device=DEVICE),
            torch.tensor([20], dtype=torch.int32, device=DEVICE), 0.25, 20, 20)  # fmt: skip
    for ops in (triton_ops, reference):
        assert torch.equal(
            ops.paged_prefill_attention(query, k_cache, v_cache, *args, fp8_qk=True),
            ops.paged_prefill_attention(query, k_cache, v_cache, *args),
        )


def test_prefill_fp8_qk_is_independent_of_chunking() -> None:
    # Q is rounded per row and K is the cache's own: a prompt attended in one chunk or in three
    # (the later ones reading the earlier keys from the cache) agrees to fp32 rounding.
    gen = torch.Generator().manual_seed(12)
    k_cache, v_cache, tables = _paged_cache([48], 4, 2, 32, torch.float32, gen, cache_dtype=FP8)
    query = torch.randn(48, 4, 32, generator=gen).to(DEVICE)
    whole = triton_ops.paged_prefill_attention(
        query, k_cache, v_cache, tables,
        torch.tensor([0, 48], dtype=torch.int32, device=DEVICE),
        torch.tensor([48], dtype=torch.int32, device=DEVICE), 0.25, 48, 48, fp8_qk=True,
    )  # fmt: skip
    for lo, hi in ((0, 5), (5, 30), (30, 48)):
        part = triton_ops.paged_prefill_attention(
            query[lo:hi], k_cache, v_cache, tables,
            torch.tensor([0, hi - lo], dtype=torch.int32, device=DEVICE),
            torch.tensor([hi], dtype=torch.int32, device=DEVICE), 0.25, hi - lo, hi,
            fp8_qk=True,
        )  # fmt: skip
        _assert_close(part, whole[lo:hi], 2e-6)


@on_gpu
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_attention_llama8b_bf16(block_size: int) -> None:
    # A whole 1000-token prompt, a 512-token chunk after a 2488-token prefix, a short chunk, and
    # a 4k prompt.
    _check_prefill(
        q_lens=[1000, 512, 77, 4096],
        seq_lens=[1000, 3000, 4000, 4096],
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=block_size,
        dtype=torch.bfloat16,
    )


@on_gpu
def test_fp8_to_fp16_conversion_is_exact() -> None:
    from kiln.kernels.triton._fp8 import fp8_to_fp16

    every = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    every = every[~every.float().isnan()].to(DEVICE)  # 254 values: all but the two NaN codes
    assert torch.equal(fp8_to_fp16(every), every.to(torch.float16))
    odd = every[:253]  # a length that is not a multiple of the four-value packing
    assert torch.equal(fp8_to_fp16(odd), odd.to(torch.float16))


@on_gpu
def test_attention_llama8b_fp8_cache() -> None:
    # Real shapes with a float8 cache: batch 1 at 4k (split-K), a batch of 64, and prefill chunks.
    _check_decode([4096], 32, 8, 128, 16, torch.bfloat16, None, cache_dtype=FP8)
    lens = torch.randint(1, 4097, (64,), generator=torch.Generator().manual_seed(5)).tolist()
    _check_decode(lens, 32, 8, 128, 16, torch.bfloat16, None, seed=5, cache_dtype=FP8)
    _check_prefill(
        [1000, 512, 77], [1000, 3000, 4000], 32, 8, 128, 16, torch.bfloat16, cache_dtype=FP8
    )


@on_gpu
def test_prefill_attention_short_chunks_bf16() -> None:
    # max_query_len <= 64 takes the small-tile configuration.
    _check_prefill([3, 64, 17], [900, 64, 2000], 32, 8, 128, 16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The backend: split attention over a mixed batch


@pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [(torch.float32, None), (torch.float16, None), (torch.float32, FP8)],
)
def test_triton_backend_matches_torch_backend(
    dtype: torch.dtype, cache_dtype: torch.dtype | None
) -> None:
    assert isinstance(get_attention_backend("triton", DEVICE), TritonAttentionBackend)
    # Prefill over a float8 cache: the Triton backend's Q.K dots run in float8, the reference
    # (the CPU's path) widens K.
    assert TritonAttentionBackend.fp8_qk and not TorchAttentionBackend.fp8_qk
    num_heads, num_kv_heads, head_dim, block_size = 4, 2, 32, 4  # 32: float8 dots
    # Two decodes, then a fresh prompt and a chunk after a cached prefix.
    q_lens = [1, 1, 6, 5]
    seq_lens = [9, 17, 6, 14]
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, block_tables = _paged_cache(
        seq_lens, block_size, num_kv_heads, head_dim, dtype, gen, cache_dtype=cache_dtype
    )
    slots: list[int] = []
    for i, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        slots += _slots(block_tables, i, range(seq_len - q_len, seq_len), block_size)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    metadata = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables,
        num_decodes=2,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    scale = head_dim**-0.5
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, metadata, scale)
    expected = TorchAttentionBackend().forward(query, k_cache, v_cache, metadata, scale)
    twin = run_split_attention(reference, query, k_cache, v_cache, metadata, scale, fp8_qk=True)
    atol = ATTN_ATOL[dtype] if dtype == torch.float32 else 5e-3
    if cache_dtype == FP8 and not INTERPRET:
        atol = max(atol, FP8_QK_GPU_ATOL)
    _assert_close(out, twin, atol)
    if cache_dtype == FP8:  # the float8 query rounding, in the prefill rows only
        assert (out[2:].float() - expected[2:].float()).abs().max() > 1e-3
    else:
        assert torch.equal(twin, expected)
    # The backends share run_split_attention, which has both kernels write their rows of one
    # output: check the rows against separate reference calls, concatenated.
    lens, tables = metadata.seq_lens, metadata.block_tables
    separate = torch.cat([
        reference.paged_decode_attention(
            query[:2], k_cache, v_cache, tables[:2], lens[:2], scale, max(seq_lens)
        ),
        reference.paged_prefill_attention(
            query[2:], k_cache, v_cache, tables[2:], metadata.query_start_loc[2:] - 2, lens[2:],
            scale, max(q_lens), max(seq_lens), fp8_qk=cache_dtype == FP8,
        ),
    ])  # fmt: skip
    assert torch.equal(twin, separate)


# ---------------------------------------------------------------------------------------------
# RMSNorm and rotary embedding: same rounding as the reference, so (nearly) exact


ELEMENTWISE_TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (3 * torch.randn(5, hidden, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(DEVICE, dtype)
    tol = ELEMENTWISE_TOL[dtype]

    out = triton_ops.rms_norm(x, weight, 1e-6)
    expected = reference.rms_norm(x, weight, 1e-6)
    assert out.dtype == expected.dtype
    _assert_close(out, expected, tol)

    normed, summed = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-6)
    normed_ref, summed_ref = reference.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, summed_ref)
    assert normed.dtype == normed_ref.dtype
    _assert_close(normed, normed_ref, tol)


def test_rms_norm_fp32_weight_promotes() -> None:
    # Like torch, an fp16 activation times an fp32 weight gives fp32.
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 32, generator=gen).to(DEVICE, torch.float16)
    weight = torch.randn(32, generator=gen).to(DEVICE)
    out = triton_ops.rms_norm(x, weight, 1e-5)
    expected = reference.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    _assert_close(out, expected, 1e-6)


@on_gpu
def test_rms_norm_llama8b_bf16() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(300, 4096, generator=gen).to(DEVICE, torch.bfloat16)
    residual = torch.randn(300, 4096, generator=gen).to(DEVICE, torch.bfloat16)
    weight = torch.rand(4096, generator=gen).to(DEVICE, torch.bfloat16)
    normed, summed = triton_ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    normed_ref, summed_ref = reference.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(summed, summed_ref)
    _assert_close(normed, normed_ref, 8e-3)


def _cos_sin_cache(max_positions: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


# Model dtype x cache dtype, and head shapes (head_dim 24: padded tiles, and a program's tile
# crossing heads), for the ops that rotate keys and write them to the cache.
ROTARY_CACHE_CASES = pytest.mark.parametrize(
    ("dtype", "cache_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.float16, torch.float16),
        (torch.float32, FP8),
        pytest.param(torch.bfloat16, torch.bfloat16, marks=on_gpu),
        pytest.param(torch.bfloat16, FP8, marks=on_gpu),
    ],
)
ROTARY_HEAD_SHAPES = pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24)]
)


@ROTARY_CACHE_CASES
@ROTARY_HEAD_SHAPES
def test_rotary_embedding_write_kv(
    dtype: torch.dtype, cache_dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(41 + head_dim)
    block_size = 4
    # q, k, v as strided views of a fused qkv projection; keys large enough that a float8 cache
    # saturates some of them.
    qkv = torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv[:, num_heads : num_heads + num_kv_heads] *= 300 if cache_dtype == FP8 else 1
    qkv = qkv.to(DEVICE, dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions = torch.tensor([0, 1, 2, 17, 63, 5], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([3, 4, -1, 9, 0, 22], dtype=torch.int64, device=DEVICE)  # -1: padding
    cos_sin = _cos_sin_cache(64, head_dim).to(DEVICE)
    shape = (6, block_size, num_kv_heads, head_dim)
    k_cache = _head_major(torch.randn(shape, generator=gen).to(DEVICE, cache_dtype))
    v_cache = _head_major(torch.randn(shape, generator=gen).to(DEVICE, cache_dtype))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    qkv_before = qkv.clone()
    args = (positions, query, key, value, cos_sin)
    q_out = triton_ops.rotary_embedding_write_kv(*args, k_cache, v_cache, slots)
    # The reference is never given padding on CUDA (its index_copy_ would fault): leave it out.
    keep = slots >= 0
    q_ref, k_rot = reference.rotary_embedding(positions, query, key, cos_sin)
    reference.write_kv_cache(k_rot[keep], value[keep], k_ref, v_ref, slots[keep])
    assert torch.equal(qkv, qkv_before), "the inputs must be left untouched"
    _assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
    # Rounded as the reference: the rotated key in the input dtype, then the cache's.
    _assert_same_cache(k_cache, k_ref, rotated=True)
    _assert_same_cache(v_cache, v_ref)
    if cache_dtype == FP8:
        assert k_cache.float().abs().max() == 448.0


@on_gpu
def test_rotary_embedding_write_kv_llama8b_bf16() -> None:
    gen = torch.Generator().manual_seed(9)
    query = torch.randn(500, 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
    key = torch.randn(500, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    value = torch.randn(500, 8, 128, generator=gen).to(DEVICE, torch.bfloat16)
    positions = torch.randint(0, 8192, (500,), generator=gen).to(DEVICE)
    slots = torch.randperm(64 * 16, generator=gen)[:500].to(DEVICE)
    cos_sin = _cos_sin_cache(8192, 128, base=500000.0).to(DEVICE)
    k_cache = _head_major(torch.zeros(64, 16, 8, 128, dtype=torch.bfloat16, device=DEVICE))
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    args = (positions, query, key, value, cos_sin)
    q_out = triton_ops.rotary_embedding_write_kv(*args, k_cache, v_cache, slots)
    q_ref = reference.rotary_embedding_write_kv(*args, k_ref, v_ref, slots)
    _assert_close(q_out, q_ref, 8e-3)
    _assert_same_cache(k_cache, k_ref, rotated=True)
    _assert_same_cache(v_cache, v_ref)


# ---------------------------------------------------------------------------------------------
# SiLU-and-multiply: same rounding as the reference (silu rounded to the dtype, then the product)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "d"),
    [(129, 40), (3, 1100)],  # odd row count, d not a power of two; d over two column blocks
)
def test_silu_and_mul(dtype: torch.dtype, num_tokens: int, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(num_tokens, 2 * d, generator=gen)).to(DEVICE, dtype)
    # Saturated gates: silu(-60) is -0 (exp overflows in fp16/fp32 math), silu(60) is 60.
    x[0, :3] = torch.tensor([-60.0, 60.0, 0.0], dtype=dtype, device=DEVICE)
    x_before = x.clone()
    out = triton_ops.silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert torch.equal(x, x_before), "the input must be left untouched"
    assert out.shape == (num_tokens, d) and out.dtype == dtype
    assert not out.isnan().any()
    _assert_close(out, expected, ELEMENTWISE_TOL[dtype])


def test_silu_and_mul_row_stride_and_empty() -> None:
    # Rows of a wider buffer (row stride != 2 * d), with leading dims kept; and zero tokens.
    gen = torch.Generator().manual_seed(4)
    wide = torch.randn(2, 5, 2 * 24 + 8, generator=gen).to(DEVICE)
    x = wide[..., : 2 * 24]
    out = triton_ops.silu_and_mul(x)
    assert out.shape == (2, 5, 24)
    _assert_close(out, reference.silu_and_mul(x), 1e-5)
    empty = triton_ops.silu_and_mul(torch.empty(0, 48, device=DEVICE))
    assert empty.shape == (0, 24)


@on_gpu
def test_silu_and_mul_llama8b_bf16() -> None:
    gen = torch.Generator().manual_seed(13)
    x = (3 * torch.randn(2048, 2 * 14336, generator=gen)).to(DEVICE, torch.bfloat16)
    out = triton_ops.silu_and_mul(x)
    expected = reference.silu_and_mul(x)
    assert out.dtype == torch.bfloat16
    _assert_close(out, expected, ELEMENTWISE_TOL[torch.bfloat16])


def test_attention_padded_head_dim() -> None:
    # head_dim 24 is padded to a 32-wide tile: the padding must be masked off.
    _check_decode([9, 30], 4, 2, 24, 4, torch.float32, num_splits=2, seed=11)
    _check_prefill([7, 18], [7, 25], 4, 2, 24, 4, torch.float32, seed=12)


# ---------------------------------------------------------------------------------------------
# Small-batch linear layers with the op before them fused in (batch-1 decode)


def _assert_close_to_scale(actual: torch.Tensor, expected: torch.Tensor, rel: float) -> None:
    """Max error within `rel` of the largest expected magnitude (matmul outputs: the error of a
    K-term sum scales with its terms, not with each output)."""
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    scale = expected.float().abs().max().item()
    err = (actual.float() - expected.float()).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x {scale:.3g}"


LINEAR_REL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}


def _no_cublas(monkeypatch: pytest.MonkeyPatch, rows: int, fused_op: bool) -> None:
    """The kernel must run, not the F.linear fallback: a fused op before the matmul takes one
    row, a plain linear up to MAX_ROWS."""
    from kiln.kernels.triton import small_batch_linear

    if rows <= (1 if fused_op else small_batch_linear.MAX_ROWS):

        def fail(*args: object, **kwargs: object) -> None:
            raise AssertionError("fell back to F.linear")

        monkeypatch.setattr(small_batch_linear, "F", type("NoLinear", (), {"linear": fail}))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])  # fused for one row; the unfused path for more
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_linear(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, with_residual: bool
) -> None:
    gen = torch.Generator().manual_seed(rows)
    k, n = 72, 40  # neither a multiple of the interpreter's 32 x 16 tiles
    x = (3 * torch.randn(rows, k, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(rows, k, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    weight = (0.1 * torch.randn(n, k, generator=gen)).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    inputs = [t.clone() for t in (x, residual) if t is not None]
    out_ref, summed_ref = reference.add_rms_norm_linear(
        x, residual, norm_weight, 1e-5, weight, bias
    )
    _no_cublas(monkeypatch, rows, fused_op=True)
    out, summed = triton_ops.add_rms_norm_linear(x, residual, norm_weight, 1e-5, weight, bias)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (x, residual))), "inputs changed"
    assert torch.equal(summed, summed_ref), "the residual stream must round as the reference"
    _assert_close_to_scale(out, out_ref, LINEAR_REL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 12])  # norm fused in; norm kernel + gated; cuBLAS
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rms_norm_linear_silu_mul(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, with_residual: bool
) -> None:
    gen = torch.Generator().manual_seed(100 + rows)
    k, n = 72, 40  # 40 output columns: the last 16-wide tile of each half is partly masked
    x = (3 * torch.randn(rows, k, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(rows, k, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    # Gates large enough to reach SiLU's saturated tails.
    weight = (0.5 * torch.randn(2 * n, k, generator=gen)).to(DEVICE, dtype)
    out_ref, summed_ref = reference.add_rms_norm_linear_silu_mul(
        x, residual, norm_weight, 1e-5, weight
    )
    assert out_ref.shape == (rows, n)
    _no_cublas(monkeypatch, rows, fused_op=False)
    out, summed = triton_ops.add_rms_norm_linear_silu_mul(x, residual, norm_weight, 1e-5, weight)
    assert torch.equal(summed, summed_ref), "the residual stream must round as the reference"
    _assert_close_to_scale(out, out_ref, LINEAR_REL[dtype])


@ROTARY_CACHE_CASES
@ROTARY_HEAD_SHAPES
@pytest.mark.parametrize(
    ("rows", "with_residual", "padding"),
    [(1, True, False), (1, False, False), (1, True, True), (3, True, False)],
    ids=["fused", "fused-first-layer", "fused-padding-slot", "unfused"],
)
def test_add_rms_norm_qkv_rotary_write_kv(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rows: int,
    with_residual: bool,
    padding: bool,
) -> None:
    """The fused op (one row) and its fallback against reference.add_rms_norm_linear followed by
    reference.rotary_embedding_write_kv. Head dim 24 puts rotate-half pairs of two heads in one
    program's tile; keys large enough that a float8 cache saturates; a padding slot (-1) writes
    nothing."""
    gen = torch.Generator().manual_seed(300 + rows + head_dim)
    k = 40
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x = (3 * torch.randn(rows, k, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(rows, k, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    weight = 0.3 * torch.randn(n, k, generator=gen)
    if cache_dtype == FP8:
        weight[num_heads * head_dim :] *= 300
    weight = weight.to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([37, 5, 63][:rows], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([9, 0, 22][:rows], dtype=torch.int64, device=DEVICE)
    if padding:
        slots[0] = -1
    cos_sin = _cos_sin_cache(64, head_dim).to(DEVICE)
    shape = (6, 4, num_kv_heads, head_dim)
    k_cache = _head_major(torch.randn(shape, generator=gen).to(DEVICE, cache_dtype))
    v_cache = _head_major(torch.randn(shape, generator=gen).to(DEVICE, cache_dtype))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    inputs = [t.clone() for t in (x, residual) if t is not None]

    head = (x, residual, norm_weight, 1e-5, weight, bias, positions, cos_sin)
    # The reference is never given padding (on CUDA its index_copy_ faults): for the padding
    # case it writes into copies that are thrown away, and the caches must stay as they were.
    caches_ref = (k_ref, v_ref) if not padding else (k_ref.clone(), v_ref.clone())
    q_ref, summed_ref = reference.add_rms_norm_qkv_rotary_write_kv(
        *head, *caches_ref, slots.clamp(min=0)
    )
    _no_cublas(monkeypatch, rows, fused_op=True)
    query, summed = triton_ops.add_rms_norm_qkv_rotary_write_kv(*head, k_cache, v_cache, slots)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (x, residual))), "inputs changed"
    assert query.shape == (rows, num_heads, head_dim)
    assert torch.equal(summed, summed_ref), "the residual stream must round as the reference"
    _assert_close_to_scale(query, q_ref, LINEAR_REL[dtype])
    written = slots[slots >= 0]
    for cache, expected in ((k_cache, k_ref), (v_cache, v_ref)):
        _assert_cache_close(cache, expected, written, LINEAR_REL[dtype])


def _assert_cache_close(
    cache: torch.Tensor, expected: torch.Tensor, written: torch.Tensor, rel: float
) -> None:
    """Slots not written bit-equal; written ones within `rel` of the largest expected magnitude
    (a projection's rounding) plus, for float8, one step of the value (a projection a last bit
    away can round to the neighbouring float8 value) and the interpreter's float8 mis-rounding
    (see _assert_same_cache)."""
    cache, expected = cache.flatten(0, 1), expected.flatten(0, 1)  # [slots, kv_heads, head_dim]
    untouched = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    untouched[written] = False
    assert torch.equal(_bits(cache[untouched]), _bits(expected[untouched]))
    a, b = cache[written].float(), expected[written].float()
    tol = rel * b.abs().max() if b.numel() else 0.0
    if cache.dtype == FP8:
        tol = tol + 2**-3 * b.abs() + 2**-9
    ok = (a - b).abs() <= tol
    if INTERPRET and cache.dtype == FP8:
        power_of_two = (b != 0) & (torch.log2(b.abs()) == torch.log2(b.abs()).round())
        ok |= (2 * a == b) & power_of_two
    assert ok.all(), list(zip(a[~ok].tolist()[:8], b[~ok].tolist()[:8]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 8, 12])  # 12 > MAX_ROWS: cuBLAS
def test_small_batch_linear(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int) -> None:
    gen = torch.Generator().manual_seed(200 + rows)
    k, n = 72, 40
    wide = torch.randn(rows, k + 8, generator=gen).to(DEVICE, dtype)  # row stride != k
    weight = (0.1 * torch.randn(n, k, generator=gen)).to(DEVICE, dtype)
    bias = torch.randn(n, generator=gen).to(DEVICE, dtype)
    expected = reference.linear(wide[:, :k], weight, bias)
    _no_cublas(monkeypatch, rows, fused_op=False)
    _assert_close_to_scale(
        triton_ops.linear(wide[:, :k], weight, bias), expected, LINEAR_REL[dtype]
    )


@on_gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_small_batch_linear_llama8b_bf16(monkeypatch: pytest.MonkeyPatch, rows: int) -> None:
    gen = torch.Generator().manual_seed(21)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=gen)).to(DEVICE, torch.bfloat16)

    x, residual, norm_weight = randn(rows, 4096), randn(rows, 4096), 1 + randn(4096, std=0.1)
    act = randn(rows, 14336)
    qkv_w, o_w = randn(6144, 4096, std=0.02), randn(4096, 4096, std=0.02)
    gate_up_w, down_w = randn(28672, 4096, std=0.02), randn(4096, 14336, std=0.02)

    def run(ops: object) -> list[torch.Tensor]:
        qkv, summed = ops.add_rms_norm_linear(x, residual, norm_weight, 1e-5, qkv_w)
        first, _ = ops.add_rms_norm_linear(x, None, norm_weight, 1e-5, gate_up_w)
        activation, _ = ops.add_rms_norm_linear_silu_mul(x, residual, norm_weight, 1e-5, gate_up_w)
        return [summed, qkv, first, ops.linear(x, o_w), activation, ops.linear(act, down_w)]

    expected = run(reference)
    if rows == 1:  # (more rows: the norms fall back to cuBLAS, the plain linears do not)
        _no_cublas(monkeypatch, rows, fused_op=True)
    actual = run(triton_ops)
    assert torch.equal(actual[0], expected[0])
    for a, e in zip(actual[1:], expected[1:]):
        _assert_close_to_scale(a, e, LINEAR_REL[torch.bfloat16])


@on_gpu
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8])
def test_add_rms_norm_qkv_rotary_write_kv_llama8b_bf16(cache_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(22)

    def randn(*shape: int, std: float = 1.0) -> torch.Tensor:
        return (std * torch.randn(*shape, generator=gen)).to(DEVICE, torch.bfloat16)

    x, residual, norm_weight = randn(1, 4096), randn(1, 4096), 1 + randn(4096, std=0.1)
    qkv_w = randn(6144, 4096, std=0.02)
    positions = torch.tensor([1000], device=DEVICE)
    slots = torch.tensor([777], device=DEVICE)
    cos_sin = _cos_sin_cache(8192, 128, base=500000.0).to(DEVICE)
    k_cache = _head_major(torch.randn(64, 16, 8, 128, generator=gen).to(DEVICE, cache_dtype))
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    head = (x, residual, norm_weight, 1e-5, qkv_w, None, positions, cos_sin)
    q_ref, summed_ref = reference.add_rms_norm_qkv_rotary_write_kv(*head, k_ref, v_ref, slots)
    query, summed = triton_ops.add_rms_norm_qkv_rotary_write_kv(*head, k_cache, v_cache, slots)
    assert torch.equal(summed, summed_ref)
    _assert_close_to_scale(query, q_ref, LINEAR_REL[torch.bfloat16])
    for cache, expected in ((k_cache, k_ref), (v_cache, v_ref)):
        _assert_cache_close(cache, expected, slots, LINEAR_REL[torch.bfloat16])


@pytest.mark.parametrize("num_tokens", [1, 3, 12])  # fused ops; plain linear; cuBLAS
def test_llama_forward_triton_ops_match_reference(num_tokens: int) -> None:
    """The model's wiring of the fused ops (residual stream across layers, biases, the first
    layer's norm without a residual) against the reference ops, both over the torch attention."""
    from kiln.models.llama import LlamaForCausalLM
    from tests.conftest import tiny_model_config

    cfg = tiny_model_config("qwen2")  # q/k/v biases
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg, max_positions=64).to(DEVICE)
    model.init_dummy_weights(seed=3)
    with torch.no_grad():  # norms away from 1 and biases away from 0, so both are exercised
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, device=DEVICE))
    block_size = 4
    num_blocks = _cdiv(num_tokens, block_size)
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=DEVICE),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=DEVICE),
        block_tables=torch.arange(num_blocks, dtype=torch.int32, device=DEVICE)[None],
        num_decodes=0,
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
    )
    input_ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=DEVICE)
    positions = torch.arange(num_tokens, device=DEVICE)

    def forward(ops: object) -> torch.Tensor:
        shape = (num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        caches = [tuple(_head_major(torch.zeros(shape, device=DEVICE)) for _ in "kv")] * 2
        with torch.no_grad():
            return model(ops, TorchAttentionBackend(), input_ids, positions, caches, metadata)

    _assert_close_to_scale(forward(triton_ops), forward(reference), 2e-5)


# ---------------------------------------------------------------------------------------------
# Greedy argmax


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(31)
    vocab = 2 * 4096 + 300  # three chunks, the last one partial
    logits = torch.randn(6, vocab, generator=gen).to(DEVICE, dtype)
    logits[1, 5000] = logits[1, 8000] = logits[1, 100] = 50.0  # ties across chunks: lowest wins
    logits[2, 4095] = logits[2, 4096] = 50.0  # ties at a chunk boundary
    logits[3] = float("-inf")  # nothing finite: index 0, as torch
    logits[4, vocab - 1] = 60.0  # the very last element
    logits[5, 7] = float("nan")  # NaN ranks first (no +inf in the row)
    out = triton_ops.argmax(logits)
    assert out.dtype == torch.int64
    assert (
        out.tolist()
        == reference.argmax(logits).tolist()
        == [
            reference.argmax(logits[0:1]).item(),
            100,
            4095,
            0,
            vocab - 1,
            7,
        ]
    )
    assert triton_ops.argmax(logits[:0]).shape == (0,)


@on_gpu
def test_argmax_llama_vocab_bf16() -> None:
    gen = torch.Generator().manual_seed(32)
    logits = (3 * torch.randn(64, 128256, generator=gen)).to(DEVICE, torch.bfloat16)
    assert torch.equal(triton_ops.argmax(logits), reference.argmax(logits))
    # A strided view (rows of a wider buffer).
    wide = torch.randn(4, 130000, generator=gen).to(DEVICE, torch.bfloat16)
    assert torch.equal(triton_ops.argmax(wide[:, :128256]), reference.argmax(wide[:, :128256]))


# ---------------------------------------------------------------------------------------------
# Copy-on-write block copies (beam search forks)


@pytest.mark.parametrize(
    "dtype, head_dim",
    [
        (torch.float32, 8),
        (torch.float16, 8),
        (torch.uint8, 5),  # a block of 5 bytes: copied byte by byte
        (torch.float8_e4m3fn, 8),
        pytest.param(torch.bfloat16, 128, marks=on_gpu),
    ],
)
def test_copy_kv_blocks(dtype: torch.dtype, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(33)
    shape = (7, 4, 2, head_dim)  # [num_blocks, block_size, num_kv_heads, head_dim]
    if dtype == torch.uint8:
        shape = (7, 1, 1, head_dim)
        caches = [torch.randint(0, 256, shape, generator=gen, dtype=dtype) for _ in range(2)]
        caches = [c.to(DEVICE) for c in caches]
    else:
        caches = [
            _head_major(torch.randn(shape, generator=gen).to(DEVICE, dtype)) for _ in range(3)
        ]
    want = [c.clone() for c in caches]
    mapping = torch.tensor([[1, 4], [1, 6], [3, 0]], dtype=torch.int64, device=DEVICE)
    by_hand = [c.view(torch.uint8).clone() for c in caches]  # the bytes, block by block
    for blocks in by_hand:
        blocks[4], blocks[6], blocks[0] = blocks[1].clone(), blocks[1].clone(), blocks[3].clone()
    reference.copy_kv_blocks(want, mapping)
    triton_ops.copy_kv_blocks(caches, mapping)
    for got, ref, hand in zip(caches, want, by_hand):
        assert torch.equal(ref.view(torch.uint8), hand)
        assert torch.equal(got.view(torch.uint8), hand)
    triton_ops.copy_kv_blocks(caches, mapping[:0])  # no copies: nothing launched


def test_copy_kv_blocks_checks_each_list_of_caches_once() -> None:
    """The address table is kept per list of caches (the runner's, every step): a second list
    of the same shapes gets its own, and the first list's calls still copy in its caches."""
    gen = torch.Generator().manual_seed(34)
    a, b = ([torch.randn((5, 2, 1, 8), generator=gen).to(DEVICE) for _ in range(2)] for _ in "ab")
    want_a, want_b = [c.clone() for c in a], [c.clone() for c in b]
    calls = [(a, want_a, [[0, 3]]), (b, want_b, [[2, 4]]), (a, want_a, [[1, 2], [4, 0]])]
    for caches, want, pairs in calls:
        mapping = torch.tensor(pairs, dtype=torch.int64, device=DEVICE)
        reference.copy_kv_blocks(want, mapping)
        triton_ops.copy_kv_blocks(caches, mapping)
    for got, ref in zip(a + b, want_a + want_b):
        assert torch.equal(got, ref)
