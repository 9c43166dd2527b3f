"""The multi-head latent attention rows of benchmarks/kernels_gpu.py (`--only mla`), at
DeepSeek-V3's decode shapes: mla_decode, the MLA decode kernel (one cached row of 64 rotary +
512 latent dims a token, bf16 queries) over a bf16 and a float8 cache, at 128 heads a rank
(TP=1) and 16 (TP=8), batch 1, 32 and 128 at 1k and 4k context, in GB/s of the cache rows the
step must read (each once). The calls rotate over copies of the cache spanning the caller's
rotate_bytes, so L2 holds none of it; max_abs_err is against the twin over the same (widened)
rows."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.kernels.kv_layout import empty_cache


@dataclass(frozen=True)
class MlaShapes:
    heads: tuple[int, ...]  # query heads a rank
    rope: int
    lora: int
    block_size: int
    batches: tuple[int, ...]
    contexts: tuple[int, ...]
    dtype: torch.dtype  # the queries'
    caches: tuple[torch.dtype, ...]


DEEPSEEK_V3 = MlaShapes((128, 16), 64, 512, 16, (1, 32, 128), (1024, 4096), torch.bfloat16,
                        (torch.bfloat16, torch.float8_e4m3fn))  # fmt: skip
TINY = MlaShapes((20,), 8, 32, 4, (2,), (20,), torch.float32, (torch.float32, torch.float8_e4m3fn))


def _rows(gen: torch.Generator) -> Callable:
    """empty_cache's allocator: standard normal rows from `gen`, rounded to the cache's type."""

    def allocate(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    return allocate


def mla_rows(
    s: MlaShapes, device: torch.device, gen: torch.Generator, record: Callable, rotate_bytes: int
) -> None:
    from kiln.kernels import reference
    from kiln.kernels import triton as triton_ops

    width = s.rope + s.lora
    scale = (128 + s.rope) ** -0.5  # V3's qk_nope + rope (the yarn mscale aside)
    cases = itertools.product(s.heads, s.caches, s.batches, s.contexts)
    for heads, cache_dtype, batch, context in cases:
        row_bytes = batch * context * width * cache_dtype.itemsize
        copies = -(-rotate_bytes // row_bytes) if device.type == "cuda" else 1
        per_seq = -(-context // s.block_size)
        num_blocks = batch * per_seq * copies
        cache = empty_cache(num_blocks, s.block_size, 1, width, cache_dtype, device, _rows(gen))
        order = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
        query = torch.randn(batch, heads, width, generator=gen, device=device).to(s.dtype)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        all_args = [(query, cache, tables, lens, scale, context, s.rope)
                    for tables in order.view(copies, batch, per_seq)]  # fmt: skip
        _, _, tables, *rest = all_args[0]
        want = reference.mla_decode_attention(query.float(), cache.float(), tables, *rest)
        err = float((triton_ops.mla_decode_attention(*all_args[0]).float() - want).abs().max())
        name = str(cache_dtype).removeprefix("torch.").replace("float8_e4m3fn", "fp8")
        record("mla_decode", f"h{heads} {name} b{batch} ctx{context}", "triton",
               [lambda a=a: triton_ops.mla_decode_attention(*a) for a in all_args],
               bytes=row_bytes, max_abs_err=err)  # fmt: skip
        del cache, all_args, want
