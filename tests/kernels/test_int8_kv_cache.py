"""The int8 KV cache's kernels against their twins in kiln.kernels.reference: the three kernels
that write keys and values (codes rounded half up, saturated at +-127) and decode (unpacked,
packed, split) and prefill attention reading codes over their whole range. On the CPU under the
Triton interpreter at tiny shapes (fp32, fp16); on a GPU the same, plus bf16."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.kernels.triton.decode_attention import paged_decode_attention_splits
from tests.kernels.test_qk_norm_rotary import _inputs as _qk_norm_inputs
from tests.kernels.test_qk_norm_rotary import _run as _run_qk_norm
from tests.kernels.test_triton_kernels import (
    ATTN_ATOL,
    DEVICE,
    DTYPES,
    _cos_sin_cache,
    _head_major,
    _packs,
    _paged_cache,
    on_gpu,
)

INT8 = torch.int8


def test_codes_round_half_up_and_saturate() -> None:
    x = torch.tensor([0.49, 0.5, -0.5, -0.51, 1.5, -1.5, 126.6, 127.4, 300.0, -300.0, -127.5])
    codes = reference.to_cache_dtype(x, INT8)
    assert codes.dtype == INT8
    assert codes.tolist() == [0, 1, 0, -1, 2, -1, 127, 127, 127, -127, -127]
    # bf16 input: rounded from its own value (the cache takes the model dtype's keys).
    assert reference.to_cache_dtype(torch.tensor([2.5], dtype=torch.bfloat16), INT8).item() == 3


def _int8_caches(shape: tuple[int, ...], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    k = _head_major(torch.randint(-127, 128, shape, generator=gen, dtype=INT8)).to(DEVICE)
    v = _head_major(torch.randint(-127, 128, shape, generator=gen, dtype=INT8)).to(DEVICE)
    return k, v, k.clone(), v.clone()


def _assert_codes(got: torch.Tensor, want: torch.Tensor, rotated: bool) -> None:
    """Values bit-equal; keys the kernel rotated within one code (its fp32 rotation may contract
    into FMAs, a last bit that can move a value across a half)."""
    if not rotated:
        assert torch.equal(got, want)
        return
    diff = (got.int() - want.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.02


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 16), (3, 1, 24)])
def test_rotary_write_kv_writes_the_twins_codes(dtype, num_heads, num_kv_heads, head_dim) -> None:
    gen = torch.Generator().manual_seed(7 + head_dim)
    qkv = 30 * torch.randn(6, num_heads + 2 * num_kv_heads, head_dim, generator=gen)
    qkv[:, num_heads] *= 8  # one head's keys past 127: saturated
    qkv = qkv.to(DEVICE, dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions = torch.tensor([0, 1, 2, 17, 63, 5], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([3, 4, -1, 9, 0, 22], dtype=torch.int64, device=DEVICE)  # -1: padding
    cos_sin = _cos_sin_cache(64, head_dim).to(DEVICE)
    k_cache, v_cache, k_ref, v_ref = _int8_caches((6, 4, num_kv_heads, head_dim), gen)
    triton_ops.rotary_embedding_write_kv(
        positions, query, key, value, cos_sin, k_cache, v_cache, slots
    )
    keep = slots >= 0
    _, k_rot = reference.rotary_embedding(positions, query, key, cos_sin)
    reference.write_kv_cache(k_rot[keep], value[keep], k_ref, v_ref, slots[keep])
    _assert_codes(k_cache, k_ref, rotated=True)
    _assert_codes(v_cache, v_ref, rotated=False)
    assert int(k_cache.abs().max()) == 127


@pytest.mark.parametrize("rows", [1, 3], ids=["fused", "unfused"])
def test_qkv_rotary_write_kv_writes_the_twins_codes(rows: int) -> None:
    """The one-row kernel (norm, projection, rotary and the cache write) and its fallback."""
    gen = torch.Generator().manual_seed(31 + rows)
    num_heads, num_kv_heads, head_dim, k = 4, 2, 16, 40
    n = (num_heads + 2 * num_kv_heads) * head_dim
    x = (3 * torch.randn(rows, k, generator=gen)).to(DEVICE)
    residual = torch.randn(rows, k, generator=gen).to(DEVICE)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE)
    weight = (5 * torch.randn(n, k, generator=gen)).to(DEVICE)  # keys and values of tens
    bias = torch.randn(n, generator=gen).to(DEVICE)
    positions = torch.tensor([37, 5, 63][:rows], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([9, 0, 22][:rows], dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin_cache(64, head_dim).to(DEVICE)
    k_cache, v_cache, k_ref, v_ref = _int8_caches((6, 4, num_kv_heads, head_dim), gen)
    head = (x, residual, norm_weight, 1e-5, weight, bias, positions, cos_sin)
    reference.add_rms_norm_qkv_rotary_write_kv(*head, k_ref, v_ref, slots)
    triton_ops.add_rms_norm_qkv_rotary_write_kv(*head, k_cache, v_cache, slots)
    # The kernel's own projection sums in another order: a value may land a code away too.
    _assert_codes(k_cache, k_ref, rotated=True)
    _assert_codes(v_cache, v_ref, rotated=True)
    assert int(k_cache.flatten(0, 1)[slots].abs().max()) > 64  # codes over the range


def test_qk_norm_rotary_write_kv_writes_the_twins_codes() -> None:
    args = _qk_norm_inputs(5, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, seed=3)
    args["k_norm_weight"] = args["k_norm_weight"] * 80  # normed keys of tens, some past 127
    args["qkv"] = args["qkv"] * 10
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, k_ref, v_ref = _int8_caches((4, 16, 2, 16), gen)
    slots = torch.tensor([3, 17, 40, 41, 60], dtype=torch.int64, device=DEVICE)
    _run_qk_norm(reference, args, (k_ref, v_ref), slots)
    _run_qk_norm(triton_ops, args, (k_cache, v_cache), slots)
    _assert_codes(k_cache, k_ref, rotated=True)
    _assert_codes(v_cache, v_ref, rotated=False)
    assert int(k_cache.flatten(0, 1)[slots].abs().max()) == 127
    assert int(v_cache.flatten(0, 1)[slots].abs().max()) > 32


def _int8_attention_inputs(seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(
        seq_lens, 16 if head_dim > 16 else 4, num_kv_heads, head_dim, dtype, gen,
        cache_dtype=torch.float32,
    )  # fmt: skip
    # Codes over the whole range; the scale keeps q . k in a softmax's usual range.
    shape = tuple(k_cache.shape)
    k_cache, v_cache = (
        _head_major(torch.randint(-127, 128, shape, generator=gen, dtype=INT8)).to(DEVICE)
        for _ in "kv"
    )
    scale = head_dim**-0.5 / 40
    return k_cache, v_cache, tables, scale, gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_splits", [1, 3], ids=["nosplit", "split3"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "unpacked"])
def test_decode_attention_over_int8_codes(monkeypatch, dtype, num_splits, packed) -> None:
    """The one-byte caches' kernels (packed where the group packs, as float8's) widen int8
    codes to the query's dtype; the reference attends in fp32 over the same codes."""
    _packs(monkeypatch, packed)
    seq_lens = [1, 13, 137]
    k_cache, v_cache, tables, scale, gen = _int8_attention_inputs(seq_lens, 4, 2, 16, dtype, 2)
    query = torch.randn(len(seq_lens), 4, 16, generator=gen).to(DEVICE, dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = paged_decode_attention_splits(
        query, k_cache, v_cache, tables, lens, scale, max(seq_lens), num_splits
    )
    want = reference.paged_decode_attention(
        query.float(), k_cache, v_cache, tables, lens, scale, max(seq_lens)
    )
    # Outputs are averages of codes (tens): the tolerance of the usual unit values, times 127.
    tol = ATTN_ATOL[dtype] * 127
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=ATTN_ATOL[dtype])
    assert float(want.abs().max()) > 20


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_attention_over_int8_codes(dtype) -> None:
    _check_prefill([21, 9, 1, 6], [21, 30, 11, 23], 4, 2, 16, dtype, seed=4)


@on_gpu
def test_int8_attention_at_llama8b_shape_on_gpu(monkeypatch) -> None:
    """32 query heads over 8 KV heads of 128, bf16 queries: prefill, then decode packed and
    unpacked, against the reference on the same GPU."""
    _check_prefill([700, 1, 300], [700, 900, 2000], 32, 8, 128, torch.bfloat16, seed=6)
    for packed in (True, False):
        _packs(monkeypatch, packed)
        seq_lens = [1, 1000, 4000]
        k_cache, v_cache, tables, scale, gen = _int8_attention_inputs(
            seq_lens, 32, 8, 128, torch.bfloat16, 7
        )
        query = torch.randn(3, 32, 128, generator=gen).to(DEVICE, torch.bfloat16)
        lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
        out = triton_ops.paged_decode_attention(
            query, k_cache, v_cache, tables, lens, scale, max(seq_lens)
        )
        want = reference.paged_decode_attention(
            query.float(), k_cache, v_cache, tables, lens, scale, max(seq_lens)
        )
        tol = ATTN_ATOL[torch.bfloat16] * 127
        torch.testing.assert_close(out.float(), want, atol=tol, rtol=ATTN_ATOL[torch.bfloat16])


def _check_prefill(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed) -> None:
    k_cache, v_cache, tables, scale, gen = _int8_attention_inputs(
        seq_lens, num_heads, num_kv_heads, head_dim, dtype, seed
    )
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(DEVICE, dtype)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    starts = starts.to(DEVICE)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    args = (tables, starts, lens, scale, max(q_lens), max(seq_lens))
    out = triton_ops.paged_prefill_attention(query, k_cache, v_cache, *args)
    want = reference.paged_prefill_attention(query.float(), k_cache, v_cache, *args)
    tol = ATTN_ATOL[dtype] * 127
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=ATTN_ATOL[dtype])


def test_copy_kv_blocks_moves_int8_codes() -> None:
    gen = torch.Generator().manual_seed(5)
    caches = [_head_major(torch.randint(-127, 128, (6, 4, 2, 16), generator=gen, dtype=INT8))]
    caches = [c.to(DEVICE) for c in caches]
    want = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 3], [2, 5]], dtype=torch.int64, device=DEVICE)
    triton_ops.copy_kv_blocks(caches, mapping)
    reference.copy_kv_blocks(want, mapping)
    assert all(torch.equal(a, b) for a, b in zip(caches, want))
