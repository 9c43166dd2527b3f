"""The Gluon sm_90 prefill attention kernel against its twin, reference.paged_prefill_attention,
on an H100/H200 (skipped elsewhere: Gluon has no interpreter; the CPU checks what it can in
test_prefill_hopper_sm90_compile.py). Llama-3.1-8B's heads unless a case says otherwise; block
tables shuffled, unused cache slots random."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton.experimental.gluon", reason="triton without Gluon")

from kiln.kernels import reference
from kiln.kernels.kv_layout import empty_cache

sm90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
pytestmark = pytest.mark.skipif(not sm90, reason="needs an sm_90 GPU (H100/H200)")

ATOL = 2e-2  # bf16 output against the fp32 twin on the same bf16 inputs
FP8 = torch.float8_e4m3fn


def _inputs(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    seed: int = 0,
) -> tuple[torch.Tensor, ...]:
    """(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens): random head-major
    caches with spare blocks, tables shuffled over them (one spare column each)."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 3
    caches = []
    for _ in "kv":
        cache = empty_cache(num_blocks, block_size, num_kv_heads, 128, torch.bfloat16,
                            torch.device("cuda"))  # fmt: skip
        cache.copy_(torch.randn(cache.shape, generator=gen))
        caches.append(cache)
    order = torch.randperm(num_blocks, generator=gen).int()
    tables = torch.zeros((len(seq_lens), max(per_seq) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    query = torch.randn(sum(q_lens), num_heads, 128, generator=gen).to("cuda", torch.bfloat16)
    starts = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return query, *caches, tables.cuda(), starts.cuda(), lens.cuda()


def _check(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int = 32,
    num_kv_heads: int = 8,
    block_size: int = 16,
    fp8: bool = False,
) -> None:
    """The kernel against the twin; fp8: over a float8 cache with float8 Q @ K^T (the twin
    rounds Q as the kernel does)."""
    from kiln.kernels.triton import prefill_attention, prefill_attention_hopper

    query, k_cache, v_cache, tables, starts, lens = _inputs(
        q_lens, seq_lens, num_heads, num_kv_heads, block_size
    )
    dots = False
    if fp8:
        k_cache, v_cache, dots = k_cache.to(FP8), v_cache.to(FP8), True
    assert prefill_attention_hopper.supports(query, k_cache, fp8_qk=dots)
    args = (tables, starts, lens, 128**-0.5, max(q_lens), max(seq_lens))
    out = prefill_attention_hopper.paged_prefill_attention(query, k_cache, v_cache, *args,
                                                           fp8_qk=dots)  # fmt: skip
    if fp8:
        expected = reference.paged_prefill_attention(query.float(), k_cache, v_cache, *args,
                                                     fp8_qk=True)  # fmt: skip
    else:
        expected = reference.paged_prefill_attention(query.float(), k_cache.float(),
                                                     v_cache.float(), *args)  # fmt: skip
    assert out.dtype == torch.bfloat16 and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=ATOL)
    # The Triton backend's entry point takes this kernel here (unless deselected), alike.
    routed = prefill_attention.paged_prefill_attention(query, k_cache, v_cache, *args,
                                                       fp8_qk=dots)  # fmt: skip
    selected = k_cache.dtype in prefill_attention_hopper.SELECTED
    assert prefill_attention_hopper.applies(query, k_cache, fp8_qk=dots) == selected
    if selected:
        assert torch.equal(routed, out)


def test_whole_prompt() -> None:
    _check([1000], [1000])


def test_chunk_after_a_cached_prefix() -> None:
    # A prefix ending mid-block and off the 128-key tile: two diagonal tiles a query tile.
    _check([512], [3000])


@pytest.mark.parametrize("q_len", [1, 2, 127, 128, 129, 255, 256, 257])
def test_causal_edges(q_len: int) -> None:
    # Chunks at, one short of and one past the 128-row query and key tiles, alone and after a
    # prefix that is a whole number of tiles.
    _check([q_len], [q_len])
    _check([q_len], [q_len + 256])


def test_varlen_batch() -> None:
    # Whole prompts, chunks after prefixes and single tokens in one launch (grid over the
    # longest; shorter sequences' spare query tiles return at once).
    _check([1000, 512, 77, 1, 129, 300], [1000, 3000, 4000, 33, 129, 301])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 8), (32, 8), (64, 8), (28, 4)])
def test_gqa_groups(num_heads: int, num_kv_heads: int) -> None:
    _check([300, 45], [300, 1045], num_heads, num_kv_heads)


@pytest.mark.parametrize("block_size", [32, 64, 128, 256])
def test_block_sizes(block_size: int) -> None:
    # Fewer, wider page pieces a key tile; from 128 on, one copy a tile inside one block.
    _check([700, 90], [700, 1290], block_size=block_size)


def test_long_prompt() -> None:
    _check([4096], [4096])


def test_writes_into_a_given_output_slice() -> None:
    from kiln.kernels.triton import prefill_attention_hopper

    query, k_cache, v_cache, tables, starts, lens = _inputs([200, 60], [200, 500], 32, 8, 16)
    args = (tables, starts, lens, 128**-0.5, 200, 500)
    whole = torch.full((query.shape[0], 40, 128), 7.0, dtype=torch.bfloat16, device="cuda")
    out = prefill_attention_hopper.paged_prefill_attention(
        query, k_cache, v_cache, *args, out=whole[:, 4:36]
    )
    assert out.data_ptr() == whole[:, 4:36].data_ptr()
    expected = reference.paged_prefill_attention(query.float(), k_cache.float(), v_cache.float(),
                                                 *args)  # fmt: skip
    torch.testing.assert_close(out.float(), expected, atol=ATOL, rtol=ATOL)
    assert bool((whole[:, :4] == 7.0).all()) and bool((whole[:, 36:] == 7.0).all())


def test_a_query_view_of_a_packed_qkv() -> None:
    # The engine's query is a view into a [tokens, q + k + v heads, 128] projection.
    from kiln.kernels.triton import prefill_attention_hopper

    query, k_cache, v_cache, tables, starts, lens = _inputs([333], [900], 32, 8, 16)
    qkv = torch.randn(333, 48, 128, device="cuda").to(torch.bfloat16)
    qkv[:, :32] = query
    args = (tables, starts, lens, 128**-0.5, 333, 900)
    out = prefill_attention_hopper.paged_prefill_attention(qkv[:, :32], k_cache, v_cache, *args)
    torch.testing.assert_close(out, prefill_attention_hopper.paged_prefill_attention(
        query, k_cache, v_cache, *args), atol=0, rtol=0)  # fmt: skip


@pytest.mark.parametrize("q_len", [1, 129])
def test_one_attention_partition_of_two_warpgroups(monkeypatch, q_len: int) -> None:
    # The variant benchmarks/kernels_gpu.py --long times beside the default.
    from kiln.kernels.triton import prefill_attention_hopper

    monkeypatch.setattr(prefill_attention_hopper, "CONSUMERS", 1)
    _check([1000, 512, q_len], [1000, 3000, q_len + 200])


@pytest.mark.parametrize("consumers", [2, 1])
def test_float8_cache_with_float8_qk(monkeypatch, consumers: int) -> None:
    # Float8 K and V through TMA (128-byte rows: one box a page piece), Q @ K^T as a float8 MMA
    # with each query row's scale folded into the softmax's, V widened to bf16 for P @ V.
    from kiln.kernels.triton import prefill_attention_hopper

    monkeypatch.setattr(prefill_attention_hopper, "CONSUMERS", consumers)
    _check([1000, 512, 77, 1, 129], [1000, 3000, 4000, 33, 129], fp8=True)
    _check([300, 45], [300, 1045], 28, 4, block_size=64, fp8=True)


def test_float8_cache_selection() -> None:
    # Widened float8 (fp8_qk False) stays with the Triton kernel.
    from kiln.kernels.triton import prefill_attention_hopper

    query, k_cache, *_ = _inputs([10], [10], 32, 8, 16)
    k8 = k_cache.to(FP8)
    assert prefill_attention_hopper.supports(query, k8, fp8_qk=True)
    assert not prefill_attention_hopper.supports(query, k8, fp8_qk=False)
