"""The kernel flavours the dense families beyond Llama add, against their twins in
kiln.kernels.reference (TRITON_INTERPRET=1 at tiny shapes without a GPU): partial rotary in the
rotary + cache-write kernel, GeGLU's gelu_tanh_and_mul with its float8-quantizing form, and
the fused norm + projection entries with GeGLU's activation and a sandwich norm of x (Gemma 2/3:
the block output RMS-normed before the residual add, `x_norm_weight`)."""

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
    DTYPES,
    ELEMENTWISE_TOL,
    FP8,
    LINEAR_REL,
    _assert_cache_close,
    _assert_close,
    _assert_close_to_scale,
    _assert_same_cache,
    _cos_sin_cache,
    _head_major,
    _no_cublas,
    on_gpu,
)
from tests.layers.test_fp8_linear import (
    FUSED_REL,
    _float8_dot,
    _no_unfused_path,
    _quantized_weight,
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


# ---- sandwich norms and GeGLU in the fused norm + projection entries --------------------------

EPS = 1e-6


def _sandwich_inputs(rows: int, k: int, dtype: torch.dtype, seed: int):
    """x (a block's output, far from unit RMS), the residual stream, the entry's norm weight and
    the x-norm's weight (Gemma's 1 + w: around 1)."""
    gen = torch.Generator().manual_seed(seed)
    x = (5 * torch.randn(rows, k, generator=gen)).to(DEVICE, dtype)
    residual = torch.randn(rows, k, generator=gen).to(DEVICE, dtype)
    norm_weight = (1 + 0.1 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    x_norm_weight = (1 + 0.3 * torch.randn(k, generator=gen)).to(DEVICE, dtype)
    return gen, x, residual, norm_weight, x_norm_weight


def _assert_stream(got: torch.Tensor, want: torch.Tensor, x_norm: bool = True) -> None:
    """The residual stream: bit-equal to the twin's without an x-norm; with one, within the
    model dtype's rounding of the normed x (its RMS is a sum the kernel orders otherwise)."""
    if not x_norm:
        assert torch.equal(got, want), "the residual stream must round as the reference"
        return
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[want.dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_reference_sandwich_is_the_norm_then_the_add() -> None:
    """The twins' x_norm_weight is rms_norm(x, x_norm_weight) added to the stream, as the
    unfused sandwich layer computes it (and no residual: the normed x is the stream)."""
    gen, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(3, 40, torch.float32, 1)
    weight = torch.randn(48, 40, generator=gen).to(DEVICE)
    x_normed = reference.rms_norm(x, x_norm_weight, EPS)
    for r in (residual, None):
        want = reference.add_rms_norm_linear(x_normed, r, norm_weight, EPS, weight)
        got = reference.add_rms_norm_linear(
            x, r, norm_weight, EPS, weight, x_norm_weight=x_norm_weight
        )
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    want_act = reference.gelu_tanh_and_mul(
        reference.add_rms_norm_linear(x_normed, residual, norm_weight, EPS, weight)[0]
    )
    got_act, _ = reference.add_rms_norm_linear_silu_mul(
        x, residual, norm_weight, EPS, weight, activation="gelu_pytorch_tanh",
        x_norm_weight=x_norm_weight,
    )  # fmt: skip
    assert torch.equal(got_act, want_act)
    with pytest.raises(ValueError, match="no gated activation"):
        reference.add_rms_norm_linear_silu_mul(x, None, norm_weight, EPS, weight, activation="relu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3])  # fused into one kernel; the norm kernel, then more
@pytest.mark.parametrize("x_norm", [True, False])
def test_fused_add_rms_norm_sandwich(dtype: torch.dtype, rows: int, x_norm: bool) -> None:
    _, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(rows, 72, dtype, 2)
    x_norm_weight = x_norm_weight if x_norm else None
    want = reference.fused_add_rms_norm(x, residual, norm_weight, EPS, x_norm_weight)
    got = triton_ops.fused_add_rms_norm(x, residual, norm_weight, EPS, x_norm_weight)
    _assert_stream(got[1], want[1], x_norm)
    _assert_close(got[0], want[0], ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 12])  # norm fused in; norm kernel + gated; cuBLAS
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("x_norm", [True, False])
def test_add_rms_norm_linear_act_mul(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, rows: int, activation: str, x_norm: bool
) -> None:
    """The gated entry (and the plain one) with GeGLU's activation and the sandwich x-norm,
    through each of its paths, against the twins."""
    gen, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(rows, 72, dtype, 3 + rows)
    x_norm_weight = x_norm_weight if x_norm else None
    weight = (0.5 * torch.randn(80, 72, generator=gen)).to(DEVICE, dtype)
    args = (x, residual, norm_weight, EPS, weight)
    want, want_sum = reference.add_rms_norm_linear_silu_mul(
        *args, activation=activation, x_norm_weight=x_norm_weight
    )
    want_lin, _ = reference.add_rms_norm_linear(*args, x_norm_weight=x_norm_weight)
    _no_cublas(monkeypatch, rows, fused_op=False)
    got, got_sum = triton_ops.add_rms_norm_linear_silu_mul(
        *args, activation=activation, x_norm_weight=x_norm_weight
    )
    _assert_stream(got_sum, want_sum, x_norm)
    _assert_close_to_scale(got, want, LINEAR_REL[dtype])
    if rows == 1:
        got_lin, got_sum = triton_ops.add_rms_norm_linear(*args, x_norm_weight=x_norm_weight)
        _assert_stream(got_sum, want_sum, x_norm)
        _assert_close_to_scale(got_lin, want_lin, LINEAR_REL[dtype])


@pytest.mark.parametrize(("dtype", "cache_dtype"), [(torch.float32, torch.float32),
                                                    (torch.float16, torch.float16),
                                                    (torch.float32, FP8),
                                                    pytest.param(torch.bfloat16, FP8,
                                                                 marks=on_gpu)])  # fmt: skip
@pytest.mark.parametrize("rows", [1, 3])
def test_add_rms_norm_qkv_rotary_write_kv_sandwich(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, cache_dtype: torch.dtype, rows: int
) -> None:
    """The attention block's entry with the x-norm (Gemma 2: the last layer's post-feed-forward
    norm folded into this layer's first kernel)."""
    num_heads, num_kv_heads, head_dim, k = 4, 2, 16, 40
    gen, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(rows, k, dtype, 30 + rows)
    n = (num_heads + 2 * num_kv_heads) * head_dim
    weight = (0.3 * torch.randn(n, k, generator=gen)).to(DEVICE, dtype)
    positions = torch.tensor([37, 5, 63][:rows], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor([9, 0, 22][:rows], dtype=torch.int64, device=DEVICE)
    cos_sin = _cos_sin_cache(64, head_dim).to(DEVICE)
    shape = (6, 4, num_kv_heads, head_dim)
    k_cache = _head_major(torch.randn(shape, generator=gen).to(DEVICE, cache_dtype))
    v_cache = _head_major(torch.randn(shape, generator=gen).to(DEVICE, cache_dtype))
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    head = (x, residual, norm_weight, EPS, weight, None, positions, cos_sin)
    q_ref, sum_ref = reference.add_rms_norm_qkv_rotary_write_kv(
        *head, k_ref, v_ref, slots, x_norm_weight=x_norm_weight
    )
    _no_cublas(monkeypatch, rows, fused_op=True)
    query, summed = triton_ops.add_rms_norm_qkv_rotary_write_kv(
        *head, k_cache, v_cache, slots, x_norm_weight=x_norm_weight
    )
    _assert_stream(summed, sum_ref)
    _assert_close_to_scale(query, q_ref, LINEAR_REL[dtype])
    for cache, expected in ((k_cache, k_ref), (v_cache, v_ref)):
        _assert_cache_close(cache, expected, slots, LINEAR_REL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=on_gpu)])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 12])  # fused; norm kernel + plain kernel; quantizing norm
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("swap_ab", [True, False])
def test_fp8_add_rms_norm_linear_act_mul_sandwich(
    monkeypatch: pytest.MonkeyPatch, dtype, static, rows, activation, swap_ab
) -> None:
    """The FP8 MLP entry (add_rms_norm_linear_silu_mul_fp8) with the x-norm and each
    activation: the float8 activation (or, at the small-batch rows, the model-dtype one the
    down projection quantizes) as the twin's."""
    _float8_dot(monkeypatch, swap_ab)
    gen, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(rows, 72, dtype, 50 + rows)
    w_fp8, w_scale = _quantized_weight(80, 72, gen)
    w_fp8, w_scale = w_fp8.to(DEVICE), w_scale.to(DEVICE)
    input_scale = torch.tensor(0.02, device=DEVICE) if static else None
    out_scale = torch.tensor(0.05, device=DEVICE) if static else None
    args = (x, residual, norm_weight, EPS, w_fp8, w_scale, input_scale, out_scale)
    kw = {"activation": activation, "x_norm_weight": x_norm_weight}
    want, want_scale, want_sum = reference.add_rms_norm_linear_silu_mul_fp8(*args, **kw)
    if rows == 1:
        _no_unfused_path(monkeypatch)
    got, got_scale, got_sum = triton_ops.add_rms_norm_linear_silu_mul_fp8(*args, **kw)
    _assert_stream(got_sum, want_sum)
    want_act = (want.float() * want_scale).to(dtype)
    if got_scale is None:  # small-batch rows: the model-dtype activation, quantized by down
        got, got_scale = reference.quantize_fp8(got, out_scale)
    got_act = (got.float() * got_scale).to(dtype)
    # Within one float8 step of the twin (the activation's last bits may differ).
    step = 2**-3 * want_act.float().abs() + FUSED_REL[dtype] * float(want_act.abs().max())
    assert ((got_act.float() - want_act.float()).abs() <= step).all()


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("rows", [1, 3])
def test_fp8_add_rms_norm_quant_and_qkv_sandwich(
    monkeypatch: pytest.MonkeyPatch, static, rows
) -> None:
    """The float8 attention entries with the x-norm: the quantizing norm (more rows) and the
    one-row qkv + rotary kernel on float8 weights."""
    num_heads, num_kv_heads, head_dim, k = 4, 2, 8, 40
    gen, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(rows, k, torch.float32, 70)
    n = (num_heads + 2 * num_kv_heads) * head_dim
    w_fp8, w_scale = _quantized_weight(n, k, gen)
    w_fp8, w_scale = w_fp8.to(DEVICE), w_scale.to(DEVICE)
    input_scale = torch.tensor(0.01, device=DEVICE) if static else None
    want = reference.add_rms_norm_quant_fp8(x, residual, norm_weight, EPS, input_scale,
                                            x_norm_weight=x_norm_weight)  # fmt: skip
    got = triton_ops.add_rms_norm_quant_fp8(x, residual, norm_weight, EPS, input_scale,
                                            x_norm_weight=x_norm_weight)  # fmt: skip
    _assert_stream(got[2], want[2])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=0)
    assert ((got[0].float() - want[0].float()).abs() <= 2**-3 * want[0].float().abs()).all()
    cos_sin = _cos_sin_cache(64, head_dim).to(DEVICE)
    positions = torch.tensor([21, 3, 9][:rows], device=DEVICE)
    slots = torch.tensor([5, 0, 7][:rows], device=DEVICE)
    caches = [_head_major(torch.zeros(3, 4, num_kv_heads, head_dim)).to(DEVICE) for _ in "kv"]
    got_caches = [c.clone() for c in caches]
    head = (x, residual, norm_weight, EPS, w_fp8, None, positions, cos_sin)
    want_q, want_sum = reference.add_rms_norm_qkv_rotary_write_kv(
        *head, *caches, slots, w_scale, input_scale, x_norm_weight
    )
    if rows == 1:
        _no_unfused_path(monkeypatch)
    got_q, got_sum = triton_ops.add_rms_norm_qkv_rotary_write_kv(
        *head, *got_caches, slots, w_scale, input_scale, x_norm_weight
    )
    _assert_stream(got_sum, want_sum)
    for g, w in ((got_q, want_q), *zip(got_caches, caches)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-5 * float(w.abs().max()))


@on_gpu
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_sandwich_entries_gemma2_9b_shapes(activation: str) -> None:
    """Gemma-2-9B's decode entries in bf16 on float8 weights (hidden 3584, MLP 14336, q 4096 +
    kv 2 x 2048): the gated MLP entry and the qkv + rotary entry with the x-norm, at one row
    (the fused kernels, split-K where the tiles cut K) against the twins on the same bf16
    inputs (the twins round where the kernels do; an fp32 twin is ~3% of the gated product's
    peak away from the bf16 one at these shapes)."""
    hidden, inter, head_dim, num_kv_heads = 3584, 14336, 256, 8
    gen, x, residual, norm_weight, x_norm_weight = _sandwich_inputs(1, hidden, torch.bfloat16, 9)
    gate_up, gate_up_scale = (t.to(DEVICE) for t in _quantized_weight(2 * inter, hidden, gen))
    qkv, qkv_scale = (t.to(DEVICE) for t in _quantized_weight(8192, hidden, gen))
    head = (x, residual, norm_weight, EPS)
    mlp = (gate_up, gate_up_scale)
    kw = {"activation": activation, "x_norm_weight": x_norm_weight}
    want, _ = reference.add_rms_norm_linear_silu_mul(*head, *mlp, **kw)
    got, _ = triton_ops.add_rms_norm_linear_silu_mul(*head, *mlp, **kw)
    _assert_close_to_scale(got.float(), want.float(), 1e-2)
    cos_sin = _cos_sin_cache(4096, head_dim).to(DEVICE)
    positions = torch.tensor([1000], device=DEVICE)
    slots = torch.tensor([1000], device=DEVICE)
    shape = (64, 16, num_kv_heads, head_dim)
    caches = [_head_major(torch.zeros(shape)).to(DEVICE, torch.bfloat16) for _ in "kv"]
    want_caches = [c.clone() for c in caches]
    rope = (positions, cos_sin)
    want_q, _ = reference.add_rms_norm_qkv_rotary_write_kv(
        *head, qkv, None, *rope, *want_caches, slots, qkv_scale, None, x_norm_weight
    )
    got_q, _ = triton_ops.add_rms_norm_qkv_rotary_write_kv(
        *head, qkv, None, *rope, *caches, slots, qkv_scale, None, x_norm_weight
    )
    _assert_close_to_scale(got_q.float(), want_q.float(), 1e-2)
    for g, w in zip(caches, want_caches):
        _assert_close_to_scale(g.float(), w.float(), 1e-2)
