"""The MLA decode kernel (kiln.kernels.triton.mla_decode) against its twin under
TRITON_INTERPRET=1: heads not a multiple of the 16-row block, partitions of the keys (split-K)
with some left empty, contexts across cache blocks, a padding row of one key, fp32 and fp16
(the interpreter returns bf16 garbage from the shared decode kernel too), the tests' tiny row
(8 rotary + 32 latent dims) and DeepSeek's (64 + 512)."""

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


@pytest.mark.parametrize(
    ("rope", "lora", "heads", "splits", "dtype"),
    [
        (8, 32, 4, 1, torch.float32),
        (8, 32, 20, 3, torch.float32),
        (8, 32, 4, 8, torch.float16),
        (64, 512, 16, 2, torch.float32),
    ],
)
def test_the_kernel_equals_its_twin(rope, lora, heads, splits, dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    block_size, seq_lens = 16, [37, 1, 16, 5]  # one key only: a graph's padding row
    blocks_per_seq = 3
    cache = empty_cache(len(seq_lens) * blocks_per_seq + 1, block_size, 1, rope + lora, dtype,
                        DEVICE)  # fmt: skip
    cache.copy_(torch.randn(cache.shape, generator=gen).to(dtype))
    # Each sequence's blocks out of order in the pool, block 0 left to no one.
    order = torch.randperm(len(seq_lens) * blocks_per_seq, generator=gen) + 1
    tables = order.view(len(seq_lens), blocks_per_seq).to(torch.int32).to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    query = torch.randn(len(seq_lens), heads, rope + lora, generator=gen).to(dtype).to(DEVICE)
    scale = (rope + 16) ** -0.5
    args = (query, cache, tables, lens, scale, max(seq_lens), rope)
    want = reference.mla_decode_attention(*args)
    got = triton_ops.mla_decode_attention(*args, num_splits=splits)
    assert got.shape == (len(seq_lens), heads, lora)
    tol = 2e-3 if dtype == torch.float16 else 1e-4
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
