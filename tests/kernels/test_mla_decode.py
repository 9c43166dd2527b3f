"""The MLA decode kernel (kiln.kernels.triton.mla_decode) against its twin under
TRITON_INTERPRET=1: heads not a multiple of the 16-row block, partitions of the keys (split-K)
with some left empty, contexts across cache blocks, a padding row of one key, fp32 and fp16
(the interpreter returns bf16 garbage from the shared decode kernel too), the tests' tiny row
(8 rotary + 32 latent dims) and DeepSeek's (64 + 512), over caches of the query's dtype and of
float8 e4m3; an int8 cache refused by both. On a GPU, DeepSeek-V3's shapes in bf16 (128 heads
a rank at TP=1, 16 at TP=8) over a bf16 and a float8 cache."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.kv_layout import empty_cache

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP8 = torch.float8_e4m3fn
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _case(seq_lens, block_size, rope, lora, heads, dtype, cache_dtype, seed=0):
    """(query, cache, block tables, seq_lens, scale, max_seq_len, rope): each sequence's blocks
    out of order in the pool, block 0 left to no one; a float8 cache holds randn rows rounded
    as the cache writes round them (reference.to_cache_dtype)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-max(seq_lens) // block_size)
    cache = empty_cache(len(seq_lens) * blocks_per_seq + 1, block_size, 1, rope + lora,
                        cache_dtype, DEVICE)  # fmt: skip
    rows = reference.to_cache_dtype(torch.randn(cache.shape, generator=gen), cache_dtype)
    cache.view(torch.uint8 if cache.element_size() == 1 else cache.dtype).copy_(
        rows.view(torch.uint8) if cache.element_size() == 1 else rows
    )  # (CPU float8 tensors copy as bytes)
    order = torch.randperm(len(seq_lens) * blocks_per_seq, generator=gen) + 1
    tables = order.view(len(seq_lens), blocks_per_seq).to(torch.int32).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), heads, rope + lora, generator=gen).to(dtype).to(DEVICE)
    scale = (rope + 16) ** -0.5
    return query, cache, tables, lens, scale, max(seq_lens), rope


@pytest.mark.parametrize(
    ("rope", "lora", "heads", "splits", "dtype", "cache_dtype"),
    [
        (8, 32, 4, 1, torch.float32, torch.float32),
        (8, 32, 20, 3, torch.float32, torch.float32),
        (8, 32, 4, 8, torch.float16, torch.float16),
        (64, 512, 16, 2, torch.float32, torch.float32),
        (8, 32, 4, 1, torch.float32, FP8),
        (8, 32, 20, 3, torch.float32, FP8),
        (8, 32, 4, 8, torch.float16, FP8),
        (64, 512, 16, 2, torch.float32, FP8),
        (64, 512, 16, 1, torch.float16, FP8),
    ],
)
def test_the_kernel_equals_its_twin(rope, lora, heads, splits, dtype, cache_dtype) -> None:
    # One key only: a graph's padding row.
    args = _case([37, 1, 16, 5], 16, rope, lora, heads, dtype, cache_dtype)
    want = reference.mla_decode_attention(*args)
    got = triton_ops.mla_decode_attention(*args, num_splits=splits)
    assert got.shape == (4, heads, lora) and got.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def test_the_twin_widens_a_float8_cache_exactly() -> None:
    """The twin over a float8 cache equals it over the same rows widened to fp32 first."""
    query, cache, *rest = _case([37, 5], 16, 8, 32, 4, torch.float32, FP8)
    widened = cache.float()
    want = reference.mla_decode_attention(query, widened, *rest)
    assert torch.equal(reference.mla_decode_attention(query, cache, *rest), want)


def test_an_int8_cache_is_refused_by_both() -> None:
    args = _case([5], 16, 8, 32, 4, torch.float32, torch.int8)
    for ops in (reference, triton_ops):
        with pytest.raises(ValueError, match="int8 KV cache for multi-head latent attention"):
            ops.mla_decode_attention(*args)


@needs_gpu
@pytest.mark.parametrize("heads", [128, 16], ids=["v3-tp1", "v3-tp8"])
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, FP8], ids=["bf16", "fp8"])
@pytest.mark.parametrize("splits", [None, 1], ids=["auto", "nosplit"])
def test_v3_shapes_on_a_gpu(heads, cache_dtype, splits) -> None:
    """DeepSeek-V3's row (64 rotary + 512 latent), bf16 queries, blocks of 16, contexts from
    one key to 4k: the kernel against its twin in fp32 over the same (widened) rows."""
    query, cache, *rest = _case([4096, 1, 777, 16, 2049], 16, 64, 512, heads, torch.bfloat16,
                                cache_dtype)  # fmt: skip
    got = triton_ops.mla_decode_attention(query, cache, *rest, num_splits=splits)
    want = reference.mla_decode_attention(query.float(), cache.float(), *rest)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
