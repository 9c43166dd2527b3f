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
