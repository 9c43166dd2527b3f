"""The online-softmax update shared by the attention kernels (flash-attention's inner step)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_update(acc, l_i, m_i, s, qk_scale, v, DOT_PRECISION: tl.constexpr):
    """Folds one key tile into the running output: `s` [M, N] are the tile's scores masked to
    -inf, to be multiplied by qk_scale > 0 (softmax_scale * log2(e); 1.0 for scores already
    scaled); `v` [N, D] its values. Returns the new (acc, l_i, m_i): the unnormalised output, the
    row sums and the row maxima, in the log2 domain. The row maxima are taken before scaling, so
    each score's scale and shift is one FMA (exact, so bit-equal, when qk_scale is 1.0). Every
    row must have seen a finite score by now, in this tile or an earlier one."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def online_softmax_update_masked(acc, l_i, m_i, s, qk_scale, v, DOT_PRECISION: tl.constexpr):
    """online_softmax_update for tiles where a row may see no key yet (a sliding window's first
    tiles): a row whose maximum is still -inf keeps m = -inf, l = 0 and weighs nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * qk_scale - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def soft_cap(s, softcap_in, softcap_out):
    """softcap * tanh(s * scale / softcap) in the log2 domain: softcap_in = scale / softcap,
    softcap_out = softcap * log2(e). tanh from exp2 (no libdevice under the interpreter); it
    saturates to +-1 where exp2 overflows or vanishes."""
    e = tl.exp2(s * (softcap_in * 2.8853900817779268))  # exp(2x): 2 * log2(e)
    return softcap_out * (1.0 - 2.0 / (e + 1.0))


@triton.jit
def online_softmax_update_rows(
    acc, l_i, m_i, s, row_scale, v, DOT_PRECISION: tl.constexpr, MASKED_ROWS: tl.constexpr
):
    """online_softmax_update with a scale per row (`row_scale` [M] > 0: a float8 query's scale
    times softmax_scale * log2(e)); MASKED_ROWS as online_softmax_update_masked."""
    m_new = tl.maximum(m_i, tl.max(s, 1) * row_scale)
    if MASKED_ROWS:  # noqa: SIM108 (resolved at compile time)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s * row_scale[:, None] - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, l_i, m_new
