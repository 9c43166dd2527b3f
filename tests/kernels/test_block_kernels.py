"""The kernel flavours the dense families beyond Llama add, against their twins in
kiln.kernels.reference (TRITON_INTERPRET=1 at tiny shapes without a GPU): partial rotary in the
rotary + cache-write kernel, and GeGLU's gelu_tanh_and_mul with its float8-quantizing form."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the kernels' @triton.jit

pytest.importorskip("triton", reason="triton is not installed (pip install kiln[triton])")

from kiln.kernels import reference
from kiln.kernels import triton as triton_ops
from kiln.layers.rotary import build_cos_sin_cache
from tests.kernels.test_triton_kernels import (
    DEVICE,
    ELEMENTWISE_TOL,
    FP8,
    _assert_close,
    _assert_same_cache,
    _head_major,
)


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32),
                                                    (torch.float16, torch.float16),
                                                    (torch.float32, FP8)])  # fmt: skip
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(32, 8), (24, 16), (16, 16)])
def test_partial_rotary_write_kv(
    dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int, rotary_dim: int
) -> None:
    """The first rotary_dim dims of each head turn; the rest reach the output and the cache
    unchanged (StableLM's 0.25, Phi-4-mini's 0.75 of a head)."""
    gen = torch.Generator().manual_seed(head_dim + rotary_dim)
    num_heads, num_kv_heads, block_size = 4, 2, 4
    qkv = torch.randn(5, num_heads + 2 * num_kv_heads, head_dim, generator=gen).to(DEVICE, dtype)
    query, key, value = qkv.split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    positions = torch.tensor([0, 3, 17, 63, 5], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([3, 4, 9, 0, 22], dtype=torch.int64, device=DEVICE)
    cos_sin = build_cos_sin_cache(rotary_dim, 64, 10000.0, None).to(DEVICE)
    shape = (6, block_size, num_kv_heads, head_dim)
    k_cache = _head_major(torch.zeros(shape).to(DEVICE, cache_dtype))
    v_cache, k_ref, v_ref = k_cache.clone(), k_cache.clone(), k_cache.clone()
    args = (positions, query, key, value, cos_sin)
    q_out = triton_ops.rotary_embedding_write_kv(*args, k_cache, v_cache, slots)
    q_ref = reference.rotary_embedding_write_kv(*args, k_ref, v_ref, slots)
    _assert_close(q_out, q_ref, ELEMENTWISE_TOL[dtype])
    assert torch.equal(q_out[..., rotary_dim:], query[..., rotary_dim:])
    _assert_same_cache(k_cache, k_ref, rotated=True)
    _assert_same_cache(v_cache, v_ref)


def test_partial_rotary_reference_is_transformers() -> None:
    """The twin turns the first dims as transformers' StableLM applies rotary."""
    from transformers.models.stablelm.modeling_stablelm import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(7, 2, 32, generator=gen), torch.randn(7, 1, 32, generator=gen)
    positions = torch.arange(7)
    table = build_cos_sin_cache(8, 16, 10000.0, None)
    ours_q, ours_k = reference.rotary_embedding(positions, q, k, table)
    cos, sin = table[positions, :4].repeat(1, 2), table[positions, 4:].repeat(1, 2)
    rot_q, rot_k = apply_rotary_pos_emb(
        q[..., :8].transpose(0, 1), k[..., :8].transpose(0, 1), cos, sin, unsqueeze_dim=0
    )
    torch.testing.assert_close(ours_q[..., :8], rot_q.transpose(0, 1))
    torch.testing.assert_close(ours_k[..., :8], rot_k.transpose(0, 1))
    assert torch.equal(ours_q[..., 8:], q[..., 8:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("num_tokens", "d"), [(9, 40), (3, 1100)])
def test_gelu_tanh_and_mul(dtype: torch.dtype, num_tokens: int, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    x = (4 * torch.randn(num_tokens, 2 * d, generator=gen)).to(DEVICE, dtype)
    x[0, :3] = torch.tensor([-60.0, 60.0, 0.0], dtype=dtype, device=DEVICE)  # tanh saturates
    out = triton_ops.gelu_tanh_and_mul(x)
    expected = reference.gelu_tanh_and_mul(x)
    assert out.shape == (num_tokens, d) and not out.isnan().any()
    _assert_close(out, expected, ELEMENTWISE_TOL[dtype])
    # GeGLU is not SiLU's kernel by mistake.
    assert (reference.silu_and_mul(x) - expected).abs().max() > 1e-2


@pytest.mark.parametrize("static", [False, True])
def test_gelu_tanh_and_mul_quant_fp8(static: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    x = (3 * torch.randn(6, 2 * 48, generator=gen)).to(DEVICE)
    scale = torch.tensor(0.02, device=DEVICE) if static else None
    out, out_scale = triton_ops.gelu_tanh_and_mul_quant_fp8(x, scale)
    ref, ref_scale = reference.gelu_tanh_and_mul_quant_fp8(x, scale)
    torch.testing.assert_close(out_scale, ref_scale)
    # Within one float8 step of the twin (the activation's last fp32 bit may differ).
    step = 2**-3 * ref.float().abs() + 2**-9
    assert ((out.float() - ref.float()).abs() <= step).all()
