"""Pure-PyTorch kernels. Each Triton kernel in kernels/triton has a twin here with the same
signature; these are the oracle in tests and the implementation on the CPU.

Shapes: packed tokens (no padding); KV cache per layer [num_blocks, block_size, num_kv_heads,
head_dim] (head-major beneath: kiln.kernels.kv_layout; indexed through the view here); a slot is
block_id * block_size + offset.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448.0
# An int8 KV cache's codes: symmetric, so -128 is never written (k and -k meet the same rounding).
INT8_KV_MAX = 127.0

_LOG2E = 1.4426950408889634
# A float8 tensor-core dot's reduction dimension is at least 32 (Hopper's float8 MMA; Triton
# refuses less): smaller heads widen as before.
FP8_DOT_MIN_HEAD_DIM = 32


def uses_fp8_qk(fp8_qk: bool, k_cache: torch.Tensor) -> bool:
    """Whether prefill attention over this cache runs Q @ K^T as a float8 dot (both twins ask
    this): Q quantized per (token, head) row to e4m3, against the float8 keys; P @ V stays
    widened (float8 weights too ran at 261 TFLOP/s against 474 on an H100, 16k causal)."""
    return (
        fp8_qk and k_cache.dtype == torch.float8_e4m3fn and k_cache.shape[3] >= FP8_DOT_MIN_HEAD_DIM
    )


def to_cache_dtype(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Rounds keys/values to the cache's element type. float8 e4m3 is unscaled and saturates at
    +-448 (as the GPU's conversion does) rather than overflowing to NaN. int8 holds the values
    rounded half up (floor(x + 0.5) in fp32, the same ops as the Triton kernels') and saturated
    at +-127: its scales are folded into the weights (kiln.models.kv_scales), as float8's are."""
    if cache_dtype == torch.int8:
        return (x.float() + 0.5).floor().clamp(-INT8_KV_MAX, INT8_KV_MAX).to(torch.int8)
    if cache_dtype == torch.float8_e4m3fn:
        x = x.float().clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x.to(cache_dtype)


def write_kv_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    block_size = k_cache.shape[1]
    # A negative slot marks a padding token (a decode batch padded to a graph size): skipped, as
    # the Triton kernel does. The check syncs, so only the CPU makes it: on CUDA the reference is
    # never given padding (graphs need a backend with supports_cuda_graphs).
    if slot_mapping.device.type == "cpu" and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    for cache, x in ((k_cache, key), (v_cache, value)):
        x = to_cache_dtype(x, cache.dtype)
        if cache.element_size() == 1:
            # index_copy_ has no float8 kernel on the CPU: copy the bytes.
            cache, x = cache.view(torch.uint8), x.view(torch.uint8)
        # Indexed through the view: a token's rows lie apart in head-major blocks.
        cache[slot_mapping // block_size, slot_mapping % block_size] = x


def _gather_context(
    cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> torch.Tensor:  # [length, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    # index_select is several times faster than advanced indexing on the CPU.
    return cache.index_select(0, block_ids[:num_blocks]).flatten(0, 1)[:length]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # written and returned when given (a slice of a larger one)
    window: int | None = None,  # sliding window: only the last `window` keys (itself included)
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32 learned logits in the denominator
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Each query attends to its sequence's first seq_lens[i] cached tokens (itself included),
    or to the last `window` of them; with `softcap` and `sinks` as attention_kinds says."""
    if window is not None or softcap is not None or sinks is not None:
        starts = torch.arange(query.shape[0] + 1, dtype=torch.int32, device=query.device)
        return _paged_attention_kinds(
            query, k_cache, v_cache, block_tables, starts, seq_lens, scale, out, window,
            softcap, sinks,
        )  # fmt: skip
    num_heads = query.shape[1]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    num_seqs = query.shape[0]
    num_blocks = (max_seq_len + block_size - 1) // block_size
    tables = block_tables[:, :num_blocks].reshape(-1).long()

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # Every sequence's context padded to the longest: [num_seqs, kv_heads, max_seq_len, dim].
        flat = cache.index_select(0, tables).view(
            num_seqs, num_blocks * block_size, *cache.shape[2:]
        )
        return flat[:, :max_seq_len].transpose(1, 2).to(query.dtype)

    keys, values = gather(k_cache), gather(v_cache)
    mask = None
    # max_seq_len is an upper bound, not the length: decodes in a mixed step get the whole step's
    # maximum, a graph-padded batch its bucket's. Only a lone sequence known (on the CPU, where
    # looking costs no sync) to be exactly max_seq_len long needs no mask.
    exact = num_seqs == 1 and query.device.type == "cpu" and int(seq_lens[0]) == max_seq_len
    if not exact:
        positions = torch.arange(max_seq_len, device=query.device)
        mask = (positions[None, :] < seq_lens[:, None].to(positions.dtype))[:, None, None, :]
    attended = F.scaled_dot_product_attention(
        query[:, :, None, :],  # [num_seqs, num_heads, 1, head_dim]
        keys,
        values,
        attn_mask=mask,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )[:, :, 0, :]
    return attended if out is None else out.copy_(attended)


def check_mla_cache(query: torch.Tensor, cache: torch.Tensor) -> None:
    """An MLA cache holds the query's dtype or unscaled float8 e4m3 (widened exactly to the
    query's dtype by both decodes). int8 is refused: its codes need per-head scales folded into
    the weights (kiln.models.kv_scales), which the latent rows (K and V at once) have none of."""
    if cache.dtype == torch.int8:
        raise ValueError(
            "an int8 KV cache for multi-head latent attention (DeepSeek): unsupported, the "
            "latent rows take no int8 scales; use kv_cache_dtype 'fp8' or 'auto'"
        )
    assert cache.dtype in (query.dtype, torch.float8_e4m3fn), (cache.dtype, query.dtype)


def mla_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, rope + lora], one query token per sequence
    cache: torch.Tensor,  # [num_blocks, block_size, 1, rope + lora]: the rows, K and V both
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including the query token
    scale: float,
    max_seq_len: int,
    rope_dim: int,
    num_splits: int | None = None,  # the GPU kernel's partitions of the keys; none here
) -> torch.Tensor:  # [num_seqs, num_heads, lora]: the attended latent
    """Multi-head latent attention's decode (kiln.models.mla): multi-query attention of every
    head over the sequence's cached rows [k_pe | c_kv], the rows' latent dims the values. A
    float8 cache's rows are widened exactly to the query's dtype (check_mla_cache)."""
    check_mla_cache(query, cache)
    out = paged_decode_attention(query, cache, cache, block_tables, seq_lens, scale, max_seq_len)
    return out[..., rope_dim:]


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length including this step's tokens
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # written and returned when given (a slice of a larger one)
    window: int | None = None,  # sliding window: only the last `window` keys (itself included)
    softcap: float | None = None,  # scores become softcap * tanh(scores / softcap)
    sinks: torch.Tensor | None = None,  # [num_heads] fp32 learned logits in the denominator
    fp8_qk: bool = False,  # float8 cache: Q @ K^T as a float8 dot (else K widened)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention for chunks whose earlier context (cached prefix, previous chunks) is
    already in the cache: the j-th of q_len queries sits at position seq_len - q_len + j and sees
    every key at or before it (or the last `window` of them). Over a float8 cache, `fp8_qk`
    rounds as the Triton kernel's float8 Q.K dots do (_paged_attention_fp8_qk)."""
    if uses_fp8_qk(fp8_qk, k_cache):
        return _paged_attention_fp8_qk(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, window,
            softcap, sinks,
        )  # fmt: skip
    if window is not None or softcap is not None or sinks is not None:
        return _paged_attention_kinds(
            query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, scale, out, window,
            softcap, sinks,
        )  # fmt: skip
    num_heads = query.shape[1]
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lengths = seq_lens.tolist()
    for i, seq_len in enumerate(lengths):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        keys = _gather_context(k_cache, block_tables[i].long(), seq_len).to(query.dtype)
        values = _gather_context(v_cache, block_tables[i].long(), seq_len).to(query.dtype)
        # 4-D, with a batch of one: torch's CPU SDPA runs its flash kernel only on 4-D inputs
        # and falls back to the math path (the whole score matrix) on 3-D ones: 2-8x slower in
        # fp32, 6-24x in bf16 at 121-2048 query tokens, the same error against fp64.
        q = query[start:end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
        k = keys.transpose(0, 1)[None]  # [1, num_kv_heads, seq_len, head_dim]
        v = values.transpose(0, 1)[None]
        if q_len == seq_len:
            mask, causal = None, True
        else:
            q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
            k_pos = torch.arange(seq_len, device=query.device)
            mask, causal = k_pos[None, :] <= q_pos[:, None], False
        o = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _paged_attention_kinds(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed sequences
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Both twins' path for a layer with a window, a soft-cap or sinks (attention_kinds),
    sequence by sequence. Only keys some query of the chunk sees are gathered: blocks a window
    left behind may be another request's by now (kiln.kv_cache frees them)."""
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    block_size = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first = seq_len - q_len  # the chunk's first query position
        lo = 0 if window is None else max(0, first - window + 1)
        k_pos = torch.arange(lo, seq_len, device=query.device)
        table = block_tables[i].long()[k_pos // block_size]
        keys = _read_cache(k_cache, table, k_pos % block_size).to(query.dtype)
        values = _read_cache(v_cache, table, k_pos % block_size).to(query.dtype)
        q_pos = torch.arange(first, seq_len, device=query.device)
        mask = attention_mask(q_pos, k_pos, window)  # [q_len, num_keys]
        q = query[start:end].transpose(0, 1)  # [num_heads, q_len, head_dim]
        k, v = keys.transpose(0, 1), values.transpose(0, 1)  # [num_kv_heads, num_keys, dim]
        if softcap is None and sinks is None:  # a window alone: torch's own kernel (4-D)
            o = F.scaled_dot_product_attention(
                q[None], k[None], v[None], attn_mask=mask, scale=scale,
                enable_gqa=num_heads != num_kv_heads,
            )[0]  # fmt: skip
        else:
            group = num_heads // num_kv_heads
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            o = attend_math(q, k, v, mask, scale, softcap, sinks)
        out[start:end] = o.transpose(0, 1)
    return out


def _paged_attention_fp8_qk(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], packed sequences
    k_cache: torch.Tensor,  # float8 e4m3
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    out: torch.Tensor | None,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention with float8 Q.K dots, rounded as the Triton kernel rounds, in the log2 domain:
    each (token, head) row of Q to e4m3 at its absmax / 448 (quantize_fp8); scores = (q8 . k)
    times that scale and scale * log2(e) (a soft-cap as the kernel's, from exp2); P @ V on the
    widened values. Queries go in slices to bound the scores' memory (this is an oracle, not the
    CPU's path)."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    group = num_heads // k_cache.shape[2]
    block_size = k_cache.shape[1]
    if out is None:
        out = torch.empty_like(query)
    qk_scale = torch.tensor(scale * _LOG2E, dtype=torch.float32)
    q8, q_scale = quantize_fp8(query.reshape(-1, head_dim), None)
    q8 = q8.float().view(query.shape)
    q_scale = q_scale.view(query.shape[:2])  # [num_tokens, num_heads]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        q_len = end - start
        if q_len == 0:
            continue
        first = seq_len - q_len
        lo = 0 if window is None else max(0, first - window + 1)
        k_pos = torch.arange(lo, seq_len, device=query.device)
        table = block_tables[i].long()[k_pos // block_size]
        keys = _read_cache(k_cache, table, k_pos % block_size).float().transpose(0, 1)
        values = _read_cache(v_cache, table, k_pos % block_size).float().transpose(0, 1)
        keys = keys.repeat_interleave(group, 0)  # [num_heads, num_keys, head_dim]
        values = values.repeat_interleave(group, 0)
        for a in range(start, end, 256):
            b = min(a + 256, end)
            q_pos = torch.arange(first + a - start, first + b - start, device=query.device)
            mask = attention_mask(q_pos, k_pos, window)  # [rows, num_keys]
            rows_scale = q_scale[a:b].transpose(0, 1)[:, :, None]  # [num_heads, rows, 1]
            s = q8[a:b].transpose(0, 1) @ keys.transpose(1, 2)  # [num_heads, rows, num_keys]
            if softcap is not None:
                e = torch.exp2((s * rows_scale) * ((scale / softcap) * 2.8853900817779268))
                s = (softcap * _LOG2E) * (1.0 - 2.0 / (e + 1.0))
                row_scale = torch.ones_like(rows_scale)
            else:
                row_scale = rows_scale * qk_scale
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(dim=-1, keepdim=True) * row_scale
            sink = None
            if sinks is not None:
                sink = (sinks.float() * _LOG2E)[:, None, None]
                m = torch.maximum(m, sink.expand_as(m))
            m = torch.where(m == float("-inf"), 0.0, m)  # a row that sees nothing (a window)
            p = torch.exp2(s * row_scale - m)
            total = p.sum(dim=-1, keepdim=True)
            if sink is not None:
                total = total + torch.exp2(sink - m)
            o = (p @ values) / torch.where(total > 0, total, 1.0)
            out[a:b] = o.transpose(0, 1).to(out.dtype)
    return out


def _read_cache(
    cache: torch.Tensor, block_ids: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:  # [n, num_kv_heads, head_dim]
    if cache.element_size() == 1:  # float8: no CPU indexing kernel; read the bytes
        return cache.view(torch.uint8)[block_ids, offsets].view(cache.dtype)
    return cache[block_ids, offsets]


def attention_mask(
    q_pos: torch.Tensor,  # [q_len] positions of the queries
    k_pos: torch.Tensor,  # [num_keys] positions of the keys
    window: int | None,
) -> torch.Tensor:  # [q_len, num_keys] bool: which keys each query sees
    """Causal, and with a window of W each query sees only the last W positions up to its own
    (Hugging Face's sliding_window_overlay: k > q - W)."""
    mask = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= k_pos[None, :] > q_pos[:, None] - window
    return mask


def attend_math(
    q: torch.Tensor,  # [num_heads, q_len, head_dim]
    k: torch.Tensor,  # [num_heads, num_keys, head_dim]
    v: torch.Tensor,  # [num_heads, num_keys, head_dim]
    mask: torch.Tensor,  # [q_len, num_keys] bool
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads]
) -> torch.Tensor:  # [num_heads, q_len, head_dim]
    """softmax(q k^T * scale) v, as Hugging Face's eager attention computes it: the scores
    soft-capped (Gemma 2: softcap * tanh(scores / softcap)) before the mask; a head's sink (gpt-oss)
    a logit that joins the softmax's denominator and weighs no value."""
    scores = (q @ k.transpose(1, 2)) * scale  # [num_heads, q_len, num_keys]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores.float(), dim=-1)
    else:
        sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        both = torch.cat([scores.float(), sink], dim=-1)
        both = both - both.amax(dim=-1, keepdim=True)
        probs = torch.softmax(both, dim=-1)[..., :-1]
    return (probs.to(v.dtype) @ v).to(q.dtype)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # layer_norm(x, weight, bias) instead
) -> torch.Tensor:
    """Transformers' LlamaRMSNorm, bit for bit: normalise in fp32, scale in the input dtype.
    `layer_norm`: the LayerNorm flavour the same kernels compute (StableLM, Cohere)."""
    if layer_norm:
        return _layer_norm(x, weight, bias, eps)
    assert bias is None, "a norm bias is the LayerNorm flavour's"
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,
    eps: float,
    x_norm_weight: torch.Tensor | None = None,  # [hidden]: x is RMS-normed by it first
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # the norm is layer_norm(..., weight, bias)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual): the residual stream and the next input.
    With x_norm_weight, x is first rms_norm(x, x_norm_weight) (sandwich_input)."""
    summed = sandwich_input(x, x_norm_weight, eps) + residual
    return rms_norm(summed, weight, eps, bias, layer_norm), summed


def sandwich_input(
    x: torch.Tensor,  # [num_tokens, hidden]: a block's output
    x_norm_weight: torch.Tensor | None,  # [hidden], or None: x as it is
    eps: float,
) -> torch.Tensor:
    """A block's output as it joins the residual stream: rms_norm(x, x_norm_weight) where the
    family norms it there (Gemma 2/3's post-attention and post-feed-forward norms, which the
    fused add + norm entries of the next block take as their `x_norm_weight`), else x."""
    return x if x_norm_weight is None else rms_norm(x, x_norm_weight, eps)


def _add_norm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    x_norm_weight: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    layer_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x' + residual), x' + residual), x' = sandwich_input(x); no residual: x'."""
    if residual is None:
        summed = sandwich_input(x, x_norm_weight, eps)
        return rms_norm(summed, norm_weight, eps, bias, layer_norm), summed
    return fused_add_rms_norm(x, residual, norm_weight, eps, x_norm_weight, bias, layer_norm)


def rotary_embedding(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32: cos half, then sin half
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX / Hugging Face Llama layout) rotary embedding, computed in fp32.
    A table narrower than head_dim turns each head's first rotary_dim dims (partial rotary,
    as transformers' StableLM and Phi); the rest pass unchanged."""
    rot = cos_sin_cache.shape[1]
    half = rot // 2
    cos_sin = cos_sin_cache[positions]
    cos = cos_sin[:, None, :half]
    sin = cos_sin[:, None, half:]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x1, x2 = x32[..., :half], x32[..., half:rot]
        turned = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
        return torch.cat([*turned, x32[..., rot:]] if rot < x.shape[-1] else turned, dim=-1).to(
            x.dtype
        )

    return rotate(query), rotate(key)


def rotary_embedding_write_kv(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> torch.Tensor:  # the rotated query
    """rotary_embedding(query, key), then write_kv_cache(rotated key, value): what follows the
    qkv projection (one kernel on the GPU; at one row, part of the projection's kernel)."""
    query, key = rotary_embedding(positions, query, key, cos_sin_cache)
    write_kv_cache(key, value, k_cache, v_cache, slot_mapping)
    return query


def silu_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
) -> torch.Tensor:  # [num_tokens, d]
    """The Llama MLP's activation, silu(gate) * up, over the fused gate_up projection's output.

    Transformers' LlamaMLP, bit for bit: act_fn(gate_proj(x)) * up_proj(x) in the model dtype,
    i.e. silu computed in fp32 and rounded to the input dtype, then the product rounded again.
    """
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K]
    bias: torch.Tensor | None = None,
) -> torch.Tensor:  # [..., N]
    return F.linear(x, weight, bias)


def add_rms_norm_linear(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K] (float8 e4m3 when weight_scale is given)
    bias: torch.Tensor | None = None,
    weight_scale: torch.Tensor | None = None,  # [N] fp32: an FP8 W8A8 projection
    input_scale: torch.Tensor | None = None,  # [] fp32 static; None: dynamic per token
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rms_norm(x + residual)), x + residual); with no residual, (linear(rms_norm(x)), x).
    The norm before a projection (the GPU fuses them for a handful of rows); with weight_scale
    the projection is fp8_linear. x_norm_weight: x is sandwich_input(x) throughout."""
    normed, summed = _add_norm(x, residual, norm_weight, eps, x_norm_weight)
    if weight_scale is not None:
        return fp8_linear(normed, weight, weight_scale, input_scale, bias), summed
    return F.linear(normed, weight, bias), summed


def split_qkv_heads(
    qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: a fused qkv projection's output
    head_dim: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views [num_tokens, heads, head_dim] of the query, key and value columns."""
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([qkv.shape[-1] - 2 * kv_size, kv_size, kv_size], dim=-1)
    return (
        q.view(-1, q.shape[-1] // head_dim, head_dim),
        k.view(-1, num_kv_heads, head_dim),
        v.view(-1, num_kv_heads, head_dim),
    )


def add_rms_norm_qkv_rotary_write_kv(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [q_size + 2 * kv_size, K]: q, k, v projections stacked
    bias: torch.Tensor | None,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, head_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    weight_scale: torch.Tensor | None = None,  # [q_size + 2 * kv_size] fp32: FP8 W8A8
    input_scale: torch.Tensor | None = None,  # [] fp32 static; None: dynamic per token
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, num_heads, head_dim], x + residual)
    """The attention block up to attending: the norm and qkv projection (add_rms_norm_linear),
    then rotary embedding on queries and keys and this step's keys/values into the paged cache
    (rotary_embedding_write_kv). Returns (rotated query, x + residual); one kernel at batch-1
    decode on the GPU."""
    qkv, summed = add_rms_norm_linear(
        x, residual, norm_weight, eps, weight, bias, weight_scale, input_scale, x_norm_weight
    )
    query, key, value = split_qkv_heads(qkv, cos_sin_cache.shape[1], k_cache.shape[2])
    rotated = rotary_embedding_write_kv(
        positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
    )
    return rotated, summed


def qk_norm_rotary_write_kv(
    qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: a fused qkv projection's output
    q_norm_weight: torch.Tensor,  # [head_dim], or [num_heads, head_dim]: a row per head
    k_norm_weight: torch.Tensor,  # [head_dim], or [num_kv_heads, head_dim]
    eps: float,
    positions: torch.Tensor,  # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_positions, rotary_dim] fp32
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    layer_norm: bool = False,  # each head LayerNormed (head_layer_norm)
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]: the rotated query
    """What follows the qkv projection of an attention with a per-head q/k RMSNorm (Qwen3,
    OLMo 2): each query and key head rms_norm'ed over head_dim with its own weights, then
    rotary_embedding_write_kv. Rounded as transformers' Qwen3Attention: the norm as rms_norm,
    then the rotation in fp32 back to the input dtype. `layer_norm`: each head
    head_layer_norm'ed instead (Cohere's use_qk_norm, StableLM 2 12B's qk_layernorm); a table
    narrower than head_dim rotates the first dims only (partial rotary)."""
    query, key, value = split_qkv_heads(qkv, k_cache.shape[3], k_cache.shape[2])
    if layer_norm:
        query = head_layer_norm(query, q_norm_weight, eps)
        key = head_layer_norm(key, k_norm_weight, eps)
    else:
        query = rms_norm(query, q_norm_weight, eps)
        key = rms_norm(key, k_norm_weight, eps)
    return rotary_embedding_write_kv(
        positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
    )


def add_rms_norm_linear_silu_mul(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2N, K]: the gate projection's rows, then the up projection's
    weight_scale: torch.Tensor | None = None,  # [2N] fp32: an FP8 W8A8 projection
    input_scale: torch.Tensor | None = None,  # [] fp32 static; None: dynamic per token
    activation: str = "silu",  # or "gelu_pytorch_tanh" (GeGLU: gelu_tanh_and_mul)
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, N], [num_tokens, K])
    """(silu_and_mul(add_rms_norm_linear(...)), x + residual): the Llama MLP up to its down
    projection (one kernel for a handful of rows on the GPU); GeGLU's with `activation`."""
    act_and_mul = gated_activation(activation)
    gate_up, summed = add_rms_norm_linear(
        x, residual, norm_weight, eps, weight, None, weight_scale, input_scale, x_norm_weight
    )
    return act_and_mul(gate_up), summed


def gated_activation(activation: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The reference's act(gate) * up for a gated MLP's activation name."""
    known = {"silu": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul}
    if activation not in known:
        raise ValueError(f"no gated activation {activation!r}; known: {', '.join(known)}")
    return known[activation]


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [rows] int64
    """Greedy sampling's argmax over [rows, vocab] logits; ties to the lowest index."""
    return logits.argmax(dim=-1)


def copy_kv_blocks(
    caches: list[torch.Tensor],  # each [num_blocks, block_size, num_kv_heads, head_dim]
    block_mapping: torch.Tensor,  # [num_copies, 2] int64 (source, destination), on the device
) -> None:
    """Copy-on-write forks: block `source` of every cache (each layer's K and V) into block
    `destination`. Destinations are distinct and never a source in the same call."""
    src, dst = block_mapping[:, 0], block_mapping[:, 1]
    for cache in caches:
        if cache.element_size() == 1:  # float8: torch's index_copy_ has no float8 kernel on CPU
            cache = cache.view(torch.uint8)
        cache.index_copy_(0, dst, cache.index_select(0, src))


# ---- FP8 W8A8 (kiln.quantization.fp8) ----------------------------------------------------------

FP8_MIN_SCALE = 1e-12  # a dynamic scale's floor: an all-zero row quantizes to zeros, not NaN


def _divided(t: torch.Tensor, divisor: float) -> torch.Tensor:
    """t / divisor in IEEE division on every device: CUDA divides by a Python number as a
    multiplication by its reciprocal (one ulp off), so the divisor goes in as a tensor, and the
    scales match the kernels' div_rn bit for bit on a GPU too."""
    return t / torch.full_like(t, divisor)


def quantize_fp8(
    x: torch.Tensor,  # [M, K]
    scale: torch.Tensor | None,  # [] or [1] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K (+ n)] float8 e4m3, [M, 1] or the scale)
    """x ~= x_fp8 * scale. Dynamic (scale None): each row's absmax / 448 (floored at
    FP8_MIN_SCALE), so each row uses e4m3's whole range. Static: x / scale saturates at +-448,
    as the float8 KV path (to_cache_dtype) does, rather than overflowing to NaN. With
    `channels` (outlier columns) those columns' remainders follow as n more (fp8_remainder).

    x / scale is the IEEE quotient. The Triton kernels get the same quotient from the scale's
    reciprocal and two FMAs (fp8_gemm.scaled_to_e4m3), not a division per value; a bare
    x * (1 / scale) would break exact ties (frequent with bf16 activations) away from zero and
    cost SmolLM2 ~1 point of perplexity."""
    x32 = x.float()
    if scale is None:
        absmax = x32.abs().amax(dim=-1, keepdim=True)
        scale = _divided(absmax, FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    scaled = (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return with_remainders(x, scaled.to(torch.float8_e4m3fn), scale, channels), scale


def fp8_remainder(
    x: torch.Tensor,  # [M, K] what was quantized, in its own dtype
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3: quantize_fp8(x, scale)
    scale: torch.Tensor,  # [M, 1] per row, or [] static
    channels: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [M, n] float8 e4m3
    """e4m3(x_J / s - q_J): what the first float8 term left of the chosen channels J (outlier
    columns, kiln.quantization.outlier_columns). x / s is the IEEE quotient, as quantize_fp8's;
    q - x/s is exact in fp32, so the remainder rounds once. A value past 448 (a static scale's
    saturation) leaves the excess as its remainder, itself saturating at 448 as quantize_fp8
    does."""
    value = x.index_select(1, channels).float() / scale
    # Gathered as bytes: float8 has no index kernels on every device.
    first = x_fp8.view(torch.uint8).index_select(1, channels).view(torch.float8_e4m3fn)
    rest = (value - first.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return rest.to(torch.float8_e4m3fn)


def with_remainders(
    x: torch.Tensor,  # [M, K]
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3
    scale: torch.Tensor,
    channels: torch.Tensor | None,
) -> torch.Tensor:  # [M, K + n] float8 e4m3: x_fp8, then fp8_remainder's columns
    """An outlier-columns projection's float8 input (x_fp8 as it is when channels is None)."""
    if channels is None:
        return x_fp8
    rest = fp8_remainder(x, x_fp8, scale, channels)
    # Concatenated as bytes, like the gather.
    both = torch.cat([x_fp8.view(torch.uint8), rest.view(torch.uint8)], dim=1)
    return both.view(torch.float8_e4m3fn)


def add_rms_norm_quant_fp8(
    x: torch.Tensor,  # [M, hidden]
    residual: torch.Tensor | None,  # [M, hidden], or None: no residual to add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
    x_norm_weight: torch.Tensor | None = None,  # [hidden]: x RMS-normed by it before the add
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # the norm is layer_norm(..., weight, bias)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(quantize_fp8 of rms_norm(x + residual): float8 rows and their scale, x + residual): an
    FP8 projection's input straight from the norm (with no residual, summed is x); x is
    sandwich_input(x) with x_norm_weight."""
    normed, summed = _add_norm(x, residual, weight, eps, x_norm_weight, bias, layer_norm)
    x_fp8, scale = quantize_fp8(normed, input_scale, channels)
    return x_fp8, scale, summed


def fp8_linear(
    x: torch.Tensor,  # [..., K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor; None: dynamic per token
    bias: torch.Tensor | None = None,  # [N] in the model dtype
) -> torch.Tensor:  # [..., N] in x.dtype
    """W8A8: quantize x (quantize_fp8), then the FP8 tensor cores' arithmetic: float8 x float8
    products (exact in fp32) summed in fp32, scaled by the row's input scale and the column's
    weight scale after the sum, plus the bias, rounded once to x.dtype."""
    x2d = x.reshape(-1, x.shape[-1])
    x_fp8, x_scale = quantize_fp8(x2d, input_scale)
    y = fp8_matmul(x_fp8, x_scale, weight, weight_scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def fp8_matmul(
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3, quantized already (quantize_fp8 or a fused norm)
    x_scale: torch.Tensor,  # [M, 1] per row, or [] / [1] per tensor, fp32
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    """fp8_linear after its quantization: float8 x float8 products (exact in fp32) summed in
    fp32, scaled by the row's and the column's scales after the sum, plus the bias, rounded once
    to out_dtype."""
    acc = x_fp8.float() @ weight.float().t()  # [M, N] fp32
    y = acc * x_scale * weight_scale.float()  # x_scale [M, 1] (dynamic) or [] / [1] (static)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def silu_and_mul_quant_fp8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d (+ n)] float8 e4m3, [M, 1] or input_scale)
    """quantize_fp8 of silu_and_mul(x): an FP8 down projection's input straight from the
    activation, as add_rms_norm_quant_fp8 is for the projections after a norm."""
    return quantize_fp8(silu_and_mul(x), input_scale, channels)


def add_rms_norm_linear_silu_mul_fp8(
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [2N, K] float8 e4m3: the gate rows, then the up rows
    weight_scale: torch.Tensor,  # [2N] fp32
    input_scale: torch.Tensor | None,  # [] fp32 static scale of x's norm; None: per token
    out_scale: torch.Tensor | None,  # [] fp32 static scale of the activation; None: per token
    activation: str = "silu",  # or "gelu_pytorch_tanh"
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """add_rms_norm_linear_silu_mul for an FP8 W8A8 MLP whose down projection takes float8:
    (activation, its scale, x + residual). The activation is float8 with its scale ([M, 1] per
    token, or out_scale) as quantize_fp8 makes it; or, where the GPU's down projection quantizes
    its input inside its own kernel (the small-batch rows), in the model dtype with scale None.
    Either way the down projection sees the same float8 values. The reference always quantizes."""
    act, summed = add_rms_norm_linear_silu_mul(
        x, residual, norm_weight, eps, weight, weight_scale, input_scale, activation,
        x_norm_weight,
    )  # fmt: skip
    act_fp8, act_scale = quantize_fp8(act.reshape(-1, act.shape[-1]), out_scale)
    return act_fp8, act_scale, summed


def gelu_tanh_and_mul(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
) -> torch.Tensor:  # [num_tokens, d]
    """GeGLU's activation, gelu_pytorch_tanh(gate) * up, rounded as transformers' GemmaMLP: the
    gelu in the input dtype (torch computes it in fp32 and rounds), then the product rounded."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul_quant_fp8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
    input_scale: torch.Tensor | None,  # [] fp32 static per-tensor scale; None: per row
    channels: torch.Tensor | None = None,  # [n] int64: append these columns' remainders
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d (+ n)] float8 e4m3, [M, 1] or input_scale)
    """quantize_fp8 of gelu_tanh_and_mul(x): a GeGLU MLP's FP8 down projection's input."""
    return quantize_fp8(gelu_tanh_and_mul(x), input_scale, channels)


def layer_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """LayerNorm (mean subtracted, then scaled and shifted) computed in fp32 and rounded once to
    the input dtype: transformers' CohereLayerNorm, and nn.LayerNorm as the GPU computes it
    (StableLM). The GPU runs it as the LayerNorm flavour of the RMSNorm kernels (rms_norm's
    `layer_norm`)."""
    return _layer_norm(x, weight, bias, eps)


def _layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """layer_norm's arithmetic, under a name rms_norm's `layer_norm` flag leaves free."""
    out = F.layer_norm(
        x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps
    )
    return out.to(x.dtype)


def head_layer_norm(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    weight: torch.Tensor,  # [num_heads, head_dim]: each head its own
    eps: float,
) -> torch.Tensor:
    """LayerNorm of each head over head_dim, without bias, scaled by that head's weights,
    computed in fp32 and rounded once to the input dtype: the q/k norms of Cohere (use_qk_norm)
    and StableLM 2 12B (qk_layernorm); the GPU runs it inside qk_norm_rotary_write_kv."""
    normed = F.layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return (normed * weight.float()).to(x.dtype)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [rows, 8 * cols] int32 in 0..15
    """[rows, cols] int32 -> the 4-bit codes, code 8j + i of a row at bits 4i of its word j
    (kiln's INT4 layout: kiln.layers.quantization.int4)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:  # [rows, cols / 8] int32
    """unpack_int4's inverse: [rows, cols] codes in 0..15 -> int32 words, 8 codes a word."""
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    # The bits do not overlap, so the sum is their OR (the top code wraps into the sign bit).
    return (c << shifts).sum(-1, dtype=torch.int32)


def dequantize_int4(
    qweight: torch.Tensor | None,  # [N, K / 8] int32: kiln's packed codes; None: mma_weight's
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32, in code units (8: symmetric)
    zero_is_min: bool = False,  # zeros hold each group's min in weight units instead
    mma_weight: torch.Tensor | None = None,  # the same codes re-laid (int4_mma_layout)
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K] in dtype
    """W4A16 weights: (code - zero) * scale, input k in group k // group_size, computed in fp32
    and rounded once to dtype; with `zero_is_min`, code * scale + min (GGUF's Q4_0 / Q4_1
    blocks: their own fp32 arithmetic, so the values equal the file's dequantized ones bit for
    bit). The codes are qweight's, or mma_weight's put back in kiln's layout
    (int4_mma_layout.unrepack, exact; N is the scales' rows)."""
    if qweight is None:
        if mma_weight is None:
            raise ValueError("dequantize_int4: no codes (qweight and mma_weight are both None)")
        from kiln.kernels.int4_mma_layout import unrepack  # it imports this module

        qweight = unrepack(mma_weight, scales.shape[0])
    codes = unpack_int4(qweight).float()
    group_size = codes.shape[1] // scales.shape[1]
    s = scales.repeat_interleave(group_size, dim=1)
    z = zeros.repeat_interleave(group_size, dim=1)
    if zero_is_min:
        return (codes * s + z).to(dtype)
    return ((codes - z) * s).to(dtype)


def int4_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    qweight: torch.Tensor | None,  # [N, K / 8] int32; None: only mma_weight holds the codes
    scales: torch.Tensor,  # [N, K / group_size] fp32
    zeros: torch.Tensor,  # [N, K / group_size] fp32
    bias: torch.Tensor | None = None,  # [N]
    zero_is_min: bool = False,  # dequantize_int4's
    mma_weight: torch.Tensor | None = None,  # the same codes re-laid (int4_mma_layout)
) -> torch.Tensor:  # [M, N] in x's dtype
    """x @ dequantize_int4(...)^T (+ bias): the weights rounded to x's dtype, as the kernel's
    dot products take them, accumulated in fp32. The codes are qweight's, or mma_weight's put
    back in kiln's layout (int4_mma_layout.unrepack, exact; N is the scales' rows) where a
    layer keeps only the copy re-laid for the sm_90 kernel (kiln.kernels.triton.int4_gemm)."""
    w = dequantize_int4(qweight, scales, zeros, zero_is_min, mma_weight, x.dtype)
    y = F.linear(x.float(), w.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# 8-bit schemes (kiln.layers.quantization: int8, fp8_block, w8a16).
INT8_MAX = 127  # symmetric int8 codes -127..127 (vLLM's and SmoothQuant's per-token range)
FP8_BLOCK = 128  # DeepSeek-V3's block: 128x128 weight scales, 1x128 activation groups


def quantize_int8(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] int8, [M, 1] fp32)
    """Per-token symmetric INT8: x ~= codes * scale, scale the row's absmax / 127 (floored at
    FP8_MIN_SCALE), codes the IEEE quotient x / scale rounded half to even."""
    x32 = x.float()
    scale = _divided(x32.abs().amax(dim=-1, keepdim=True), INT8_MAX).clamp(min=FP8_MIN_SCALE)
    codes = torch.round(x32 / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return codes, scale


def int8_matmul(
    x_int8: torch.Tensor,  # [M, K] int8
    x_scale: torch.Tensor,  # [M, 1] fp32
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32, per output channel
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    """INT8 tensor-core arithmetic: int8 x int8 products summed exactly in int32, then (as
    fp32) scaled by the row's and the column's scales, plus the bias, rounded once."""
    # float64 holds every int32 partial sum exactly, and CPU matmuls take it.
    acc = (x_int8.double() @ weight.double().t()).to(torch.int32)
    y = acc.float() * x_scale * weight_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype)


def int8_linear(
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # [N, K] int8
    weight_scale: torch.Tensor,  # [N] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """W8A8 INT8: quantize_int8 of x per token, then int8_matmul."""
    x_int8, x_scale = quantize_int8(x)
    return int8_matmul(x_int8, x_scale, weight, weight_scale, bias, x.dtype)


def add_rms_norm_quant_int8(
    x: torch.Tensor,  # [M, hidden]
    residual: torch.Tensor | None,  # [M, hidden], or None: no residual to add
    weight: torch.Tensor,  # [hidden]
    eps: float,
    bias: torch.Tensor | None = None,  # [hidden], the LayerNorm flavour's
    layer_norm: bool = False,  # the norm is layer_norm(..., weight, bias)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # ([M, hidden] int8, [M, 1] fp32, sum)
    """(quantize_int8 of rms_norm(x + residual): int8 rows and their scales, x + residual): a
    W8A8 INT8 projection's input straight from the norm (with no residual, summed is x)."""
    normed, summed = _add_norm(x, residual, weight, eps, None, bias, layer_norm)
    codes, scale = quantize_int8(normed)
    return codes, scale, summed


def silu_and_mul_quant_int8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d] int8, [M, 1] fp32)
    """quantize_int8 of silu_and_mul(x): a W8A8 INT8 down projection's input straight from the
    activation."""
    return quantize_int8(silu_and_mul(x))


def gelu_tanh_and_mul_quant_int8(
    x: torch.Tensor,  # [M, 2 * d]: gate in the first half, up in the second
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, d] int8, [M, 1] fp32)
    """quantize_int8 of gelu_tanh_and_mul(x): a GeGLU MLP's W8A8 INT8 down projection's input."""
    return quantize_int8(gelu_tanh_and_mul(x))


def quantize_fp8_groups(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # ([M, K] float8 e4m3, [M, ceil(K / 128)] fp32)
    """Per token-group FP8 (DeepSeek-V3's activations): each run of FP8_BLOCK inputs of a row
    (the last may be shorter) scaled by its own absmax / 448, as quantize_fp8 scales a row."""
    m, k = x.shape
    groups = -(-k // FP8_BLOCK)
    x32 = F.pad(x.float(), (0, groups * FP8_BLOCK - k)).view(m, groups, FP8_BLOCK)
    scale = _divided(x32.abs().amax(dim=-1, keepdim=True), FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
    codes = (x32 / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return codes.view(m, -1)[:, :k], scale.view(m, groups)


def fp8_block_matmul(
    x_fp8: torch.Tensor,  # [M, K] float8 e4m3 (quantize_fp8_groups)
    x_scales: torch.Tensor,  # [M, ceil(K / 128)] fp32
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scales: torch.Tensor,  # [N, ceil(K / 128)] fp32: each row's scale of each K block
    bias: torch.Tensor | None,  # [N]
    out_dtype: torch.dtype,
) -> torch.Tensor:  # [M, N] in out_dtype
    """Block-scaled FP8: per block of FP8_BLOCK inputs, float8 products summed in fp32, scaled
    by the row's group scale and the column's block scale, added to an fp32 accumulator
    (DeepSeek-V3's promotion of partial sums); plus the bias, rounded once."""
    k = x_fp8.shape[1]
    acc = torch.zeros(x_fp8.shape[0], weight.shape[0], device=x_fp8.device)
    for g, start in enumerate(range(0, k, FP8_BLOCK)):
        part = (
            x_fp8[:, start : start + FP8_BLOCK].float()
            @ weight[:, start : start + FP8_BLOCK].float().t()
        )
        acc += part * x_scales[:, g : g + 1] * weight_scales[:, g].float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.to(out_dtype)


def fp8_block_linear(
    x: torch.Tensor,  # [M, K] in the model dtype
    weight: torch.Tensor,  # [N, K] float8 e4m3
    weight_scales: torch.Tensor,  # [N, ceil(K / 128)] fp32
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [M, N] in x's dtype
    """FP8 with 128x128 weight blocks: quantize_fp8_groups of x, then fp8_block_matmul."""
    x_fp8, x_scales = quantize_fp8_groups(x)
    return fp8_block_matmul(x_fp8, x_scales, weight, weight_scales, bias, x.dtype)


def dequantize_w8(
    weight: torch.Tensor,  # [N, K] int8 or float8 e4m3
    scales: torch.Tensor,  # [N, groups] fp32: per group of K / groups inputs (1: per channel)
    mins: torch.Tensor | None = None,  # as scales: each group's min in weight units
) -> torch.Tensor:  # [N, K] fp32
    """Weight-only 8-bit weights: code * its group's scale (+ its min: GGUF's blocks, whose
    code * scale is exact in fp32, so the sum rounds once, as gguf's own arithmetic does)."""
    group_size = weight.shape[1] // scales.shape[1]
    w = weight.float() * scales.float().repeat_interleave(group_size, dim=1)
    if mins is None:
        return w
    return w + mins.float().repeat_interleave(group_size, dim=1)


def w8a16_linear(
    x: torch.Tensor,  # [M, K] fp16 / bf16 / fp32
    weight: torch.Tensor,  # [N, K] int8 or float8 e4m3
    scales: torch.Tensor,  # [N, groups] fp32
    bias: torch.Tensor | None = None,  # [N]
    mins: torch.Tensor | None = None,  # [N, groups] fp32 (dequantize_w8's)
) -> torch.Tensor:  # [M, N] in x's dtype
    """W8A16: x @ dequantize_w8(...)^T (+ bias), the weights rounded to x's dtype as the
    kernel's dot products take them, accumulated in fp32 (int4_linear's arithmetic)."""
    w = dequantize_w8(weight, scales, mins).to(x.dtype)
    y = F.linear(x.float(), w.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fused_moe(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's [gate; up] rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]: each expert's down projection
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32: each chosen expert's weight
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int: the chosen experts
    w13_scale: torch.Tensor | None = None,  # [num_experts] or [num_experts, 2 * inter] fp32
    w2_scale: torch.Tensor | None = None,  # [num_experts] or [num_experts, hidden] fp32
    w13_bias: torch.Tensor | None = None,  # [num_experts, 2 * inter]
    w2_bias: torch.Tensor | None = None,  # [num_experts, hidden]
    swiglu: tuple[float, float] | None = None,  # gpt-oss's clamped SwiGLU (alpha, limit)
) -> torch.Tensor:  # [num_tokens, hidden]
    """The routed experts' gated MLPs, weighted and summed per token: a loop over the experts
    any token chose, each running its tokens' rows in the model dtype (as transformers' Mixtral
    and Qwen-MoE experts do), the weighted sum kept in fp32 and rounded once. Float8 weights
    (with their per-expert or per-output-channel scales) are widened to the model dtype (exact)
    and their products scaled in fp32 before rounding: weight-only FP8; 8-bit codes with a
    scale per row and 128 inputs (3-D scales: W8A16 in groups of 128) are dequantized and
    rounded to the model dtype before the product. Biases (gpt-oss) are
    added to each projection's output, the down bias before the routing weight; the
    activation is SiLU(gate) * up, or with `swiglu` clamped_swiglu's. An id outside
    [0, num_experts) names an expert another rank holds (expert parallelism: -1) and adds
    nothing."""
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        if not 0 <= expert < w13.shape[0]:
            continue
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = _expert_linear(x[token], w13[expert], w13_scale, w13_bias, expert)
        act = silu_and_mul(gate_up) if swiglu is None else clamped_swiglu(gate_up, *swiglu)
        down = _expert_linear(act, w2[expert], w2_scale, w2_bias, expert)
        out.index_add_(0, token, down.float() * topk_weights[token, slot, None].float())
    return out.to(x.dtype)


def moe_route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    dtype: torch.dtype,
    grouped: SigmoidRouting | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, top_k] fp32 weights, [.., top_k] ids)
    """Softmax over the experts in fp32, the top k, renormalised to sum to 1 when `renormalize`
    (Mixtral; Qwen's norm_topk_prob), then rounded to the model dtype `dtype` as transformers
    rounds them before weighting the experts' outputs. With `grouped`, DeepSeek-V3's routing
    instead (sigmoid_group_route). Device ops of fixed shapes: no host sync."""
    if grouped is not None:
        return sigmoid_group_route(router_logits, top_k, renormalize, grouped)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype).float(), ids


@dataclass(frozen=True)
class SigmoidRouting:
    """DeepSeek-V3's router (GLM-4.5's too): sigmoid scores, the choice made on the scores
    plus `bias` (e_score_correction_bias, [num_experts] fp32) within the best `topk_group` of
    `n_group` equal groups of experts, the weights the chosen experts' unbiased scores times
    `scaling` (routed_scaling_factor)."""

    bias: torch.Tensor
    n_group: int = 1
    topk_group: int = 1
    scaling: float = 1.0


def sigmoid_group_route(
    router_logits: torch.Tensor,  # [num_tokens, num_experts]
    top_k: int,
    renormalize: bool,
    routing: SigmoidRouting,
) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, top_k] fp32 weights, [.., top_k] ids)
    """sigmoid(logits) in fp32; a group's score the sum of its two best biased scores; the top
    k biased scores among the best topk_group groups' experts (largest first); their unbiased
    scores, renormalised (+1e-20) with `renormalize`, times the scaling, left in fp32 as
    transformers weights the experts' outputs with them."""
    num_tokens, num_experts = router_logits.shape
    scores = torch.sigmoid(router_logits.float())
    choice = scores + routing.bias.float()
    if routing.topk_group < routing.n_group:
        groups = choice.view(num_tokens, routing.n_group, -1)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, routing.topk_group, dim=-1)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.unsqueeze(-1).expand_as(groups).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.scaling, ids


def fused_moe_fp8(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden] float8 e4m3
    w2: torch.Tensor,  # [num_experts, hidden, inter] float8 e4m3
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    w13_scale: torch.Tensor | None = None,  # [E] or [E, 2 * inter] fp32 (required)
    w2_scale: torch.Tensor | None = None,  # [E] or [E, hidden] fp32 (required)
) -> torch.Tensor:  # [num_tokens, hidden]
    """fused_moe for float8 experts on float8 activations (W8A8, the tensor cores' FP8 GEMM):
    each token's hidden state quantized per row (quantize_fp8, dynamic), gate_up in fp32 scaled
    by the row's and the expert's scales and rounded to x's dtype, silu_and_mul_quant_fp8 per
    (token, expert) pair, the down product in fp32 scaled likewise and weighted, rounded to x's
    dtype, the k of a token summed in fp32 and rounded once."""
    if w13_scale is None or w2_scale is None:
        raise ValueError("fused_moe_fp8 takes float8 experts with their scales")
    x_fp8, x_scale = quantize_fp8(x, None)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = x_fp8[token].float() @ w13[expert].float().T
        gate_up = (gate_up * x_scale[token] * _row_scale(w13_scale, expert)).to(x.dtype)
        act_fp8, act_scale = silu_and_mul_quant_fp8(gate_up, None)
        down = (act_fp8.float() @ w2[expert].float().T) * act_scale
        down = down * _row_scale(w2_scale, expert) * topk_weights[token, slot, None].float()
        out.index_add_(0, token, down.to(x.dtype).float())
    return out.to(x.dtype)


def fused_moe_fp8_block(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden] float8 e4m3
    w2: torch.Tensor,  # [num_experts, hidden, inter] float8 e4m3
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int
    w13_scale: torch.Tensor | None = None,  # [E, 2 * inter, ceil(hidden / 128)] fp32 (required)
    w2_scale: torch.Tensor | None = None,  # [E, hidden, ceil(inter / 128)] fp32 (required)
) -> torch.Tensor:  # [num_tokens, hidden]
    """fused_moe for experts with 128x128 block scales (DeepSeek-V3's recipe, each row's scale
    of each K block, as fp8_block_linear takes them): each token's hidden state quantized per
    group of 128 inputs (quantize_fp8_groups), gate_up by fp8_block_matmul rounded to x's
    dtype, silu_and_mul then quantized per group, the down product in fp32 weighted and
    rounded to x's dtype, the k of a token summed in fp32 and rounded once. An id outside
    [0, num_experts) (another rank's expert) adds nothing."""
    if w13_scale is None or w2_scale is None or w13_scale.dim() != 3 or w2_scale.dim() != 3:
        raise ValueError("fused_moe_fp8_block takes float8 experts with their block scales")
    x_fp8, x_scales = quantize_fp8_groups(x)
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        if not 0 <= expert < w13.shape[0]:
            continue
        token, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        gate_up = fp8_block_matmul(
            x_fp8[token], x_scales[token], w13[expert], w13_scale[expert], None, x.dtype
        )
        act_fp8, act_scales = quantize_fp8_groups(silu_and_mul(gate_up))
        down = fp8_block_matmul(act_fp8, act_scales, w2[expert], w2_scale[expert], None,
                                torch.float32)  # fmt: skip
        down = (down * topk_weights[token, slot, None].float()).to(x.dtype)
        out.index_add_(0, token, down.float())
    return out.to(x.dtype)


def dequantize_block_rows(
    weight: torch.Tensor,  # [..., N, K] float8 e4m3
    scales: torch.Tensor,  # [..., N, ceil(K / 128)] fp32: each row's scale of each K block
) -> torch.Tensor:  # [..., N, K] fp32
    """Block-scaled float8 weights widened: each code times its row's scale of its K block."""
    k = weight.shape[-1]
    return weight.float() * scales.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def _row_scale(scale: torch.Tensor, expert: int) -> torch.Tensor:
    """An expert's weight scale, broadcastable over its product's [rows, N]."""
    return scale[expert] if scale.dim() == 1 else scale[expert][None, :]


def fused_moe_decode(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]: each expert's [gate; up] rows
    w2: torch.Tensor,  # [num_experts, hidden, inter]: each expert's down projection
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32: each chosen expert's weight
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int: the chosen experts
    w13_scale: torch.Tensor | None = None,  # [E], [E, 2 * inter] or [E, 2 * inter, KB] fp32
    w2_scale: torch.Tensor | None = None,  # [E], [E, hidden] or [E, hidden, KB] fp32
    w13_bias: torch.Tensor | None = None,  # [E, 2 * inter]: gpt-oss's expert biases
    w2_bias: torch.Tensor | None = None,  # [E, hidden]
    swiglu: tuple[float, float] | None = None,  # gpt-oss's clamped SwiGLU (alpha, limit)
) -> torch.Tensor:  # [num_tokens, hidden]
    """fused_moe for a few tokens (decode), reading only each (token, slot)'s chosen expert (one
    gather per slot, no host sync): gate_up in fp32 from the widened weights (block scales, 3-D:
    each row's scale of each 128 inputs, applied to the widened codes), scaled, biased, rounded
    to x's dtype; silu_and_mul (or clamped_swiglu); the down product kept in fp32, scaled,
    biased, weighted and summed over the slots in slot order, rounded once."""
    args = (x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, w13_bias, w2_bias, swiglu)
    return _decode_sum(*args).to(x.dtype)


def _decode_sum(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu: tuple[float, float] | None,
) -> torch.Tensor:  # [num_tokens, hidden] fp32: fused_moe_decode before its rounding
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot].long()
        gate_up = _gathered_gemv(x.float(), w13, w13_scale, ids)
        if w13_bias is not None:
            gate_up = gate_up + w13_bias[ids].float()
        gate_up = gate_up.to(x.dtype)
        act = silu_and_mul(gate_up) if swiglu is None else clamped_swiglu(gate_up, *swiglu)
        down = _gathered_gemv(act.float(), w2, w2_scale, ids)
        if w2_bias is not None:
            down = down + w2_bias[ids].float()
        out += down * topk_weights[:, slot, None].float()
    return out


def fused_moe_decode_routed(
    x: torch.Tensor,  # [num_tokens, hidden]: the residual stream
    norm_weight: torch.Tensor | None,  # [hidden]: the RMSNorm before the experts; None: none
    eps: float,
    router_logits: torch.Tensor,  # [num_tokens, num_experts] in the model dtype
    top_k: int,
    renormalize: bool,
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden]
    w2: torch.Tensor,  # [num_experts, hidden, inter]
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu: tuple[float, float] | None = None,
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # ([T, hidden], [T, 1] logits)
    int4_zeros: tuple[torch.Tensor, torch.Tensor] | None = None,  # INT4 experts' (w13, w2)
    # zero points: w13 / w2 are packed codes and w13_scale / w2_scale their group scales
) -> torch.Tensor:  # [num_tokens, hidden]
    """A decode step's MoE block after its router: rms_norm(x) run through the experts
    moe_route picks from `router_logits` (fused_moe_decode), plus, with `shared` (Qwen2-MoE:
    its shared expert's output and its gate's logit), sigmoid(logit) * output, added in fp32
    before the one rounding. The GPU norms and routes inside the experts' first launch: its
    norm scales the dot products by the row's rsqrt at the end (fp32 agrees to ~1e-6; bf16
    within a rounding of the normed input)."""
    normed = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    weights, ids = moe_route(router_logits, top_k, renormalize, x.dtype)
    if int4_zeros is not None:  # fused_moe_int4_decode's
        assert w13_scale is not None and w2_scale is not None, "INT4 experts need their scales"
        out = _int4_decode_sum(normed, w13, w2, weights, ids, w13_scale, w2_scale, *int4_zeros)
    else:
        out = _decode_sum(
            normed, w13, w2, weights, ids, w13_scale, w2_scale, w13_bias, w2_bias, swiglu
        )
    if shared is not None:
        out = out + torch.sigmoid(shared[1].float()) * shared[0].float()
    return out.to(x.dtype)


def _gathered_gemv(
    x: torch.Tensor,  # [T, K] fp32
    weight: torch.Tensor,  # [E, N, K]
    scale: torch.Tensor | None,  # [E] or [E, N]
    ids: torch.Tensor,  # [T] int64
) -> torch.Tensor:  # [T, N] fp32
    if weight.element_size() == 1:  # gathered as bytes: float8 has no index kernels everywhere
        rows = weight.view(torch.uint8)[ids].view(weight.dtype).float()
    else:
        rows = weight[ids].float()
    if scale is not None and scale.dim() == 3:  # block scales: the widened weights scaled
        rows = dequantize_block_rows(rows, scale[ids])
    product = torch.bmm(rows, x[:, :, None])[:, :, 0]
    if scale is None or scale.dim() == 3:
        return product
    return product * (scale[ids][:, None] if scale.dim() == 1 else scale[ids])


def _expert_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    expert: int,
) -> torch.Tensor:
    b = None if bias is None else bias[expert]
    if scale is None:
        return F.linear(x, weight, None if b is None else b.to(x.dtype))
    if scale.dim() == 3:  # a scale per row and 128 inputs: the weights rounded to x's dtype
        w = dequantize_block_rows(weight, scale[expert]).to(x.dtype).float()
        product = F.linear(x.float(), w)
        return (product if b is None else product + b.float()).to(x.dtype)
    product = F.linear(x.float(), weight.float())  # fp32 as the kernel's accumulator
    product = product * scale[expert]  # [] per expert, or [rows] per output channel
    if b is not None:
        product = product + b.float()
    return product.to(x.dtype)


def dequantize_int4_experts(
    qweight: torch.Tensor,  # [E, N, K / 8] int32: each expert's packed codes (kiln's layout)
    scales: torch.Tensor,  # [E, N, K / group_size] fp32
    zeros: torch.Tensor,  # [E, N, K / group_size] fp32, in code units
) -> torch.Tensor:  # [E, N, K] fp32
    """dequantize_int4 of each expert: (code - zero) * scale, input k in group k // group_size."""
    codes = unpack_int4(qweight).float()
    group_size = codes.shape[-1] // scales.shape[-1]
    s = scales.float().repeat_interleave(group_size, dim=-1)
    return (codes - zeros.float().repeat_interleave(group_size, dim=-1)) * s


def fused_moe_int4(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # [num_experts, 2 * inter, hidden / 8] int32: [gate; up] rows' codes
    w2: torch.Tensor,  # [num_experts, hidden, inter / 8] int32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] fp32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int (-1: another rank's expert)
    w13_scale: torch.Tensor,  # [num_experts, 2 * inter, hidden / group_size] fp32
    w2_scale: torch.Tensor,  # [num_experts, hidden, inter / group_size] fp32
    w13_zero: torch.Tensor,  # as w13_scale, zero points in code units (8: symmetric)
    w2_zero: torch.Tensor,  # as w2_scale
) -> torch.Tensor:  # [num_tokens, hidden]
    """W4A16 experts for a step of many tokens (prefill): fused_moe on the experts the step
    touches, each dequantized (dequantize_int4_experts) and rounded to x's dtype, as
    int4_linear's dot products take its weights."""
    num_experts = w13.shape[0]
    touched = torch.unique(topk_ids)
    touched = touched[(touched >= 0) & (touched < num_experts)].long()
    index = torch.full((num_experts,), -1, dtype=torch.long, device=x.device)
    index[touched] = torch.arange(touched.numel(), device=x.device)
    local = topk_ids.long()
    ids = torch.where(
        (local >= 0) & (local < num_experts), index[local.clamp(0, num_experts - 1)], -1
    )
    w13d = dequantize_int4_experts(w13[touched], w13_scale[touched], w13_zero[touched])
    w2d = dequantize_int4_experts(w2[touched], w2_scale[touched], w2_zero[touched])
    return fused_moe(x, w13d.to(x.dtype), w2d.to(x.dtype), topk_weights, ids)


def fused_moe_int4_decode(
    x: torch.Tensor,  # [num_tokens, hidden]
    w13: torch.Tensor,  # as fused_moe_int4's
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,  # [num_tokens, top_k]: this rank's experts only
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_zero: torch.Tensor,
    w2_zero: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, hidden]
    """fused_moe_decode on W4A16 experts: each (token, slot)'s chosen expert only, its codes
    dequantized in fp32 ((code - zero) * scale, as the GEMVs do in registers), gate_up rounded
    to x's dtype, SiLU(gate) * up, the down products weighted and summed in fp32 in slot
    order, rounded once."""
    args = (w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, w13_zero, w2_zero)
    return _int4_decode_sum(x, *args).to(x.dtype)


def _int4_decode_sum(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor,
    w2_scale: torch.Tensor,
    w13_zero: torch.Tensor,
    w2_zero: torch.Tensor,
) -> torch.Tensor:  # [num_tokens, hidden] fp32: fused_moe_int4_decode before its rounding
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for slot in range(topk_ids.shape[1]):
        ids = topk_ids[:, slot].long()
        rows = dequantize_int4_experts(w13[ids], w13_scale[ids], w13_zero[ids])
        gate_up = torch.bmm(rows, x.float()[:, :, None])[:, :, 0].to(x.dtype)
        act = silu_and_mul(gate_up)
        rows = dequantize_int4_experts(w2[ids], w2_scale[ids], w2_zero[ids])
        down = torch.bmm(rows, act.float()[:, :, None])[:, :, 0]
        out += down * topk_weights[:, slot, None].float()
    return out


def clamped_swiglu(
    x: torch.Tensor,  # [num_tokens, 2 * d]: gate in the first half, up in the second
    alpha: float,
    limit: float,
) -> torch.Tensor:  # [num_tokens, d]
    """gpt-oss's expert activation as transformers' GptOssExperts computes it in the model
    dtype: gate clamped above at `limit`, up to +-`limit`, (up + 1) * gate * sigmoid(alpha *
    gate). (Its checkpoint interleaves gate and up columns; kiln's loader makes them halves.)"""
    gate, up = x.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def lora_shrink(
    x: torch.Tensor,  # [T, hidden_in]: the model dtype, or float8 e4m3 with x_scale
    lora_a: torch.Tensor,  # [slots, slices * rank, hidden_in]: each slot's stacked A matrices
    token_slots: torch.Tensor,  # [T] int32: each token's adapter slot, -1 for none
    x_scale: torch.Tensor | None = None,  # [] / [1] or [T, 1] fp32: a float8 x's scale(s)
    token_order: torch.Tensor | None = None,  # [T] int32: the rows grouped by slot; None: as is
) -> torch.Tensor:  # [T, slices * rank] in lora_a's dtype, zero where the slot is -1
    """LoRA's first product for a step that mixes adapters: each token's row times its own
    slot's A (all slices at once), accumulated in fp32 and rounded once. A float8 x (the input
    a float8 base GEMM read) counts as x * x_scale. `token_order` (a permutation of the rows
    that the kernels visit them in, adapter by adapter) does not change the result."""
    picked = lora_a[token_slots.clamp(min=0).long()].float()  # [T, K, hidden_in]
    y = torch.einsum("th,tkh->tk", x.float(), picked)
    if x_scale is not None:
        y = y * x_scale.float().reshape(-1 if x_scale.dim() == 2 else 1, 1)  # [T, 1] or one
    return torch.where((token_slots >= 0)[:, None], y, 0.0).to(lora_a.dtype)


def lora_expand(
    out: torch.Tensor,  # [T, n_out] the base layer's output, added to in place
    y: torch.Tensor,  # [T, slices * rank]: lora_shrink's result
    lora_b: torch.Tensor,  # [slots, n_out, rank]: each slot's B rows, the scaling folded in
    token_slots: torch.Tensor,  # [T] int32: each token's adapter slot, -1 for none
    slice_bounds: tuple[int, ...],  # column boundaries of the fused slices: (0, q, q+k, ..., n_out)
    token_order: torch.Tensor | None = None,  # [T] int32: the rows grouped by slot; None: as is
) -> None:
    """LoRA's second product added to the base output: output column n of slice i reads the
    slice's own rank-wide block of y, so a fused qkv or gate_up layer runs one expand.
    `token_order` as lora_shrink's: the result does not depend on it."""
    rank = lora_b.shape[2]
    picked = lora_b[token_slots.clamp(min=0).long()].float()  # [T, n_out, rank]
    live = (token_slots >= 0)[:, None]
    for i in range(len(slice_bounds) - 1):
        lo, hi = slice_bounds[i], slice_bounds[i + 1]
        block = y[:, i * rank : (i + 1) * rank].float()
        delta = torch.einsum("tr,tnr->tn", block, picked[:, lo:hi])
        out[:, lo:hi] += torch.where(live, delta, 0.0).to(out.dtype)
