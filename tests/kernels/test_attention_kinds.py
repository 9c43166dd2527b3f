"""Per-layer attention kinds in the attention kernels and their twins: a sliding window, a
logit soft-cap (Gemma 2) and per-head sinks (gpt-oss). The twins against a brute-force oracle
written here; the Triton kernels (under TRITON_INTERPRET=1 on the CPU, fp32 and fp16, float8
caches) against the twins. Cache slots a window leaves behind are poisoned with NaN: a kernel
that reads one (a block the KV manager freed is another request's by now) fails."""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

from kiln.kernels import reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = torch.device("cpu" if INTERPRET else "cuda")
FP8 = torch.float8_e4m3fn
ATOL = {torch.float32: 3e-5, torch.float16: 3e-3}


def _head_major(cache: torch.Tensor) -> torch.Tensor:
    return cache.transpose(1, 2).contiguous().transpose(1, 2)


def _inputs(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, window,
            seed=0, cache_dtype=None):  # fmt: skip
    """(query, k_cache, v_cache, block_tables, query_start_loc, seq_lens); slots before the
    first query's window hold NaN."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(per_seq) + 2
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros((len(seq_lens), max(per_seq) + 1), dtype=torch.int32)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n].int()
        used += n
        if window is not None:
            for pos in range(max(0, seq_lens[i] - q_lens[i] - window + 1)):
                block = int(tables[i, pos // block_size])
                k[block, pos % block_size] = float("nan")
                v[block, pos % block_size] = float("nan")
    k_cache = _head_major(k.to(cache_dtype or dtype)).to(DEVICE)
    v_cache = _head_major(v.to(cache_dtype or dtype)).to(DEVICE)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    starts = [0]
    for q_len in q_lens:
        starts.append(starts[-1] + q_len)
    qsl = torch.tensor(starts, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    return query, k_cache, v_cache, tables.to(DEVICE), qsl, lens


def _brute_force(query, k_cache, v_cache, tables, qsl, lens, scale, window, softcap, sinks):
    """Query by query, head by head, in float64."""
    out = torch.zeros(query.shape, dtype=torch.float64, device=query.device)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = query.shape[1] // num_kv_heads
    for i, seq_len in enumerate(lens.tolist()):
        start, end = int(qsl[i]), int(qsl[i + 1])
        for j in range(start, end):
            pos = seq_len - (end - start) + (j - start)
            keys = [p for p in range(pos + 1) if window is None or p > pos - window]
            slots = [(int(tables[i, p // block_size]), p % block_size) for p in keys]
            for h in range(query.shape[1]):
                kv = h // group
                kk = torch.stack([k_cache[b, o, kv].double() for b, o in slots])
                vv = torch.stack([v_cache[b, o, kv].double() for b, o in slots])
                s = kk @ query[j, h].double() * scale
                if softcap is not None:
                    s = torch.tanh(s / softcap) * softcap
                w = torch.exp(s - s.max())
                denom = w.sum()
                if sinks is not None:
                    denom = denom + math.exp(float(sinks[h]) - float(s.max()))
                out[j, h] = (w[:, None] * vv).sum(0) / denom
    return out


KINDS = [
    pytest.param(3, None, False, id="window3"),
    pytest.param(7, None, False, id="window7"),
    pytest.param(20, None, False, id="window20"),
    pytest.param(None, 5.0, False, id="softcap"),
    pytest.param(None, None, True, id="sinks"),
    pytest.param(6, 3.0, True, id="all"),
]


def _sinks(num_heads: int, on: bool) -> torch.Tensor | None:
    if not on:
        return None
    return torch.linspace(-1.0, 3.0, num_heads, dtype=torch.float32, device=DEVICE)


@pytest.mark.parametrize(("window", "softcap", "sinks_on"), KINDS)
def test_twins_equal_brute_force(window, softcap, sinks_on) -> None:
    # Prefill chunks (a whole prompt, a chunk after a prefix, one token) and decodes.
    q_lens, seq_lens = [21, 9, 1], [21, 30, 11]
    args = _inputs(q_lens, seq_lens, 4, 2, 8, 4, torch.float32, window)
    query, k_cache, v_cache, tables, qsl, lens = args
    scale, sinks = 8**-0.5, _sinks(4, sinks_on)
    kinds = {"window": window, "softcap": softcap, "sinks": sinks}
    out = reference.paged_prefill_attention(
        query, k_cache, v_cache, tables, qsl, lens, scale, 21, 30, **kinds
    )
    expected = _brute_force(*args, scale, window, softcap, sinks)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    last = qsl[1:] - 1  # each sequence's last query: a decode of the same context
    decoded = reference.paged_decode_attention(
        query[last], k_cache, v_cache, tables, lens, scale, 30, **kinds
    )
    torch.testing.assert_close(decoded.double(), expected[last], atol=1e-5, rtol=1e-5)


def test_window_past_the_context_is_plain_attention() -> None:
    query, k_cache, v_cache, tables, qsl, lens = _inputs(
        [21, 9], [21, 30], 4, 2, 8, 4, torch.float32, None
    )
    args = (query, k_cache, v_cache, tables, qsl, lens, 0.3, 21, 30)
    plain = reference.paged_prefill_attention(*args)
    torch.testing.assert_close(reference.paged_prefill_attention(*args, window=30), plain)


# ---- the Triton kernels against their twins -------------------------------------------------

triton = pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.attention.backend import AttentionKind, AttentionMetadata  # noqa: E402
from kiln.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from kiln.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from kiln.kernels import triton as triton_ops  # noqa: E402
from kiln.kernels.triton import decode_attention  # noqa: E402
from kiln.kernels.triton.decode_attention import paged_decode_attention_splits  # noqa: E402


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any()
    torch.testing.assert_close(actual.float(), expected.float(), atol=ATOL[dtype], rtol=ATOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap", "sinks_on"), KINDS)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "block_size"), [(4, 2, 4), (2, 1, 16)])
def test_prefill_kernel(dtype, window, softcap, sinks_on, num_heads, num_kv_heads, block_size):
    # Two query tiles of a prompt, a chunk after a prefix ending mid-block, one token, and a
    # long chunk whose tiles start past their windows (16-key tiles in the interpreter).
    q_lens, seq_lens = [21, 9, 1, 40], [21, 30, 11, 70]
    args = _inputs(q_lens, seq_lens, num_heads, num_kv_heads, 16, block_size, dtype, window)
    query, k_cache, v_cache, tables, qsl, lens = args
    kinds = {"window": window, "softcap": softcap, "sinks": _sinks(num_heads, sinks_on)}
    rest = (tables, qsl, lens, 0.25, 40, 70)
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, *rest, **kinds)
    expected = reference.paged_prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), *rest, **kinds
    )
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("window", "softcap", "sinks_on"), [pytest.param(None, None, False, id="plain"), *KINDS]
)
def test_prefill_kernel_fp8_qk(dtype, window, softcap, sinks_on) -> None:
    # Float8 Q.K dots round Q per row: the twin rounds the same way, so the kernel matches it as
    # tightly as the widened path matches its twin; both stay near the widened result (the
    # float8 rounding itself), which they must differ from.
    # head_dim 32: float8 tensor-core dots reduce over at least 32 (reference.uses_fp8_qk).
    q_lens, seq_lens = [21, 9, 1, 40], [21, 30, 11, 70]
    args = _inputs(q_lens, seq_lens, 4, 2, 32, 4, dtype, window, seed=3, cache_dtype=FP8)
    query, k_cache, v_cache, tables, qsl, lens = args
    kinds = {"window": window, "softcap": softcap, "sinks": _sinks(4, sinks_on)}
    rest = (tables, qsl, lens, 32**-0.5, 40, 70)
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, *rest, **kinds, fp8_qk=True)
    twin = reference.paged_prefill_attention(
        query.float(), k_cache, v_cache, *rest, **kinds, fp8_qk=True
    )
    if INTERPRET:
        _close(out, twin, dtype)
    else:
        # Hopper's float8 tensor cores accumulate in fewer bits than the twin's fp32 (with
        # float8 P.V too, since removed, up to 1.6e-2 on an H100: fp16 queries, windowed).
        assert not out.isnan().any()
        torch.testing.assert_close(out.float(), twin.float(), atol=2.5e-2, rtol=0)
    widened = reference.paged_prefill_attention(
        query.float(), k_cache.float(), v_cache.float(), *rest, **kinds
    )
    for result in (twin, out.float()):
        error = (result - widened).abs()
        assert 0 < error.mean() < 0.02 and error.max() < 0.15, (error.mean(), error.max())


def _check_decode(dtype, window, softcap, sinks_on, num_splits, cache_dtype=None, group=2):
    seq_lens = [1, 13, 45, 137]
    num_kv_heads = 2
    num_heads = group * num_kv_heads
    q_lens = [1] * len(seq_lens)
    query, k_cache, v_cache, tables, _, lens = _inputs(
        q_lens, seq_lens, num_heads, num_kv_heads, 16, 4, dtype, window, cache_dtype=cache_dtype
    )
    kinds = {"window": window, "softcap": softcap, "sinks": _sinks(num_heads, sinks_on)}
    if num_splits is None:
        out = triton_ops.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, 0.25, 4096, **kinds
        )
    else:
        out = paged_decode_attention_splits(
            query, k_cache, v_cache, tables, lens, 0.25, 4096, num_splits, **kinds
        )
    expected = reference.paged_decode_attention(
        query.float(), k_cache.float(), v_cache.float(), tables, lens, 0.25, 137, **kinds
    )
    _close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("window", "softcap", "sinks_on"), KINDS)
@pytest.mark.parametrize("num_splits", [1, 3, None], ids=["nosplit", "split3", "auto"])
def test_decode_kernel(dtype, window, softcap, sinks_on, num_splits) -> None:
    _check_decode(dtype, window, softcap, sinks_on, num_splits)


@pytest.mark.parametrize(("window", "softcap", "sinks_on"), KINDS)
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
def test_decode_kernel_fp8_cache(monkeypatch, window, softcap, sinks_on, packed, num_splits):
    # Float8 caches: the packed kernel (windows and soft-caps; sinks take the unpacked one) and
    # the unpacked kernel's V-prefetch loop.
    if not packed:
        monkeypatch.setattr(decode_attention, "packing", lambda group, head_dim: 0)
    _check_decode(torch.float16, window, softcap, sinks_on, num_splits, FP8, group=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "kind",
    [AttentionKind(5), AttentionKind(None, 2.0), AttentionKind(3, 1.0)],
    ids=["window", "softcap", "both"],
)
@pytest.mark.parametrize("sinks_on", [False, True], ids=["", "sinks"])
def test_backends_mixed_step(dtype, kind, sinks_on) -> None:
    # A step of two decodes, a fresh prompt and a chunk after a prefix, through both backends
    # (run_split_attention hands the layer's kind to both kernels); slots behind the windows
    # hold NaN.
    q_lens, seq_lens = [1, 1, 6, 5], [9, 17, 6, 14]
    window = kind.sliding_window
    query, k_cache, v_cache, tables, qsl, lens = _inputs(
        q_lens, seq_lens, 4, 2, 16, 4, dtype, window
    )
    metadata = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=DEVICE),
        query_start_loc=qsl,
        seq_lens=lens,
        block_tables=tables,
        num_decodes=2,
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
    )
    sinks = _sinks(4, sinks_on)
    out = TritonAttentionBackend().forward(query, k_cache, v_cache, metadata, 0.25, kind, sinks)
    expected = TorchAttentionBackend().forward(
        query.float(), k_cache.float(), v_cache.float(), metadata, 0.25, kind, sinks
    )
    _close(out, expected, dtype)
    brute = _brute_force(
        query.float(), k_cache.float(), v_cache.float(), tables, qsl, lens, 0.25, window,
        kind.logit_softcap, sinks,
    )  # fmt: skip
    torch.testing.assert_close(expected.double(), brute, atol=1e-5, rtol=1e-5)
