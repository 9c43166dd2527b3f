"""Multi-head latent attention (DeepSeek-V2 / V3) over the paged cache, absorbed: each token
caches one row [k_pe | c_kv] (the shared rotary key, then the kv_a_layernorm'ed latent), and
every query head attends to those rows as multi-query attention. kv_b_proj's key half W_UK
moves into the query (q_nope @ W_UK per head gives its latent-space part) and its value half
W_UV after the softmax (the attended latent @ W_UV^T per head gives its value), so K and V are
the same rows: the runner gives a layer one cache tensor for both (ModelConfig.
kv_tensors_per_layer). Decodes read the rows with ops.mla_decode_attention (the latent
out); prefill chunks with the backend's kernels, whose output columns past the rotary ones are
the latent.

The same call as blocks.RopeAttention (project_qkv, attend, kind), so DecoderLayer runs it."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from kiln.attention.backend import FULL_ATTENTION, AttentionKind
from kiln.attention.torch_backend import aligned
from kiln.distributed.parallel_state import ParallelContext
from kiln.kernels import reference
from kiln.layers.linear import Linear, TensorSplit, UnquantizedLinearMethod
from kiln.models.blocks import KVCache, LinearMethodFactory, StepInputs, norm_then_project
from kiln.models.config import ModelConfig
from kiln.models.mla_config import mla_softmax_scale

# transformers' DeepseekV2/V3RMSNorm of q_a_layernorm and kv_a_layernorm keeps its default
# epsilon (the config's rms_norm_eps is the decoder norms').
LATENT_NORM_EPS = 1e-6


class LatentAttention(nn.Module):
    """One layer's MLA. `qkv_a_proj` fuses what reads the normed stream: q_a_proj (or q_proj,
    when q_lora_rank is None) and kv_a_proj_with_mqa; then q_a_layernorm and q_b_proj make the
    query. Under tensor parallelism the heads split (q_b_proj / q_proj rows, kv_b_proj rows,
    o_proj columns) and the low-rank projections and the cache's latent are every rank's.
    kv_b_proj stays in the model dtype whatever the quantization (its halves are multiplied
    into the query and the output here, not applied as a projection)."""

    kind: AttentionKind = FULL_ATTENTION

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
        full: ModelConfig | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = heads = cfg.num_attention_heads  # this rank's
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.lora, self.v_dim = cfg.kv_lora_rank, cfg.v_head_dim
        self.q_lora = cfg.q_lora_rank
        self.scale = mla_softmax_scale(cfg)
        qk = self.nope + self.rope
        q_width = heads * qk if self.q_lora is None else self.q_lora
        kv_a = self.lora + self.rope
        a_split = q_split = kv_b_split = o_split = None
        if ctx is not None and ctx.tp_size > 1:
            assert full is not None, "under TP the layer is also given the whole model's config"
            r, all_heads = ctx.tp_rank, full.num_attention_heads

            def head_rows(width: int) -> TensorSplit:
                return TensorSplit(ctx, rows=((r * heads * width, heads * width),),
                                   full_sizes=(all_heads * width,))  # fmt: skip

            if self.q_lora is None:  # q_proj's rows are this rank's heads', kv_a's all
                a_split = TensorSplit(
                    ctx, rows=((r * q_width, q_width), (0, kv_a)), full_sizes=(all_heads * qk, kv_a)
                )
            else:
                q_split = head_rows(qk)
            kv_b_split = head_rows(self.nope + self.v_dim)
            o_split = TensorSplit(ctx, cols=(r * heads * self.v_dim, heads * self.v_dim))
        self.qkv_a_proj = Linear(
            cfg.hidden_size, q_width + kv_a, bias=cfg.attention_bias,
            output_sizes=[q_width, kv_a], method=method(f"{prefix}.qkv_a_proj"), dtype=dtype,
            split=a_split,
        )  # fmt: skip
        self.q_a_layernorm: nn.Parameter | None = None
        self.q_b_proj: Linear | None = None
        if self.q_lora is not None:
            self.q_a_layernorm = nn.Parameter(torch.ones(self.q_lora, dtype=dtype))
            self.q_b_proj = Linear(
                self.q_lora, heads * qk, bias=False, method=method(f"{prefix}.q_b_proj"),
                dtype=dtype, split=q_split,
            )  # fmt: skip
        self.kv_a_layernorm = nn.Parameter(torch.ones(self.lora, dtype=dtype))
        self.kv_b_proj = Linear(
            self.lora, heads * (self.nope + self.v_dim), bias=False,
            method=UnquantizedLinearMethod(), dtype=dtype, split=kv_b_split,
        )  # fmt: skip
        self.kv_b_proj.applied = False
        self.o_proj = Linear(
            heads * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias,
            method=method(f"{prefix}.o_proj"), dtype=dtype, split=o_split,
        )  # fmt: skip
        # The cache write is the rotary + write kernel turning by this identity table (the keys
        # arrive rotated): K and V share the tensor, so both writes must be the same bytes.
        self.register_buffer("identity_rope", torch.tensor([[1.0, 0.0]]), persistent=False)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight as (W_UK [heads, nope, lora], W_UV [heads, v, lora])."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.lora)
        return w[:, : self.nope], w[:, self.nope :]

    def project_qkv(
        self,
        step: StepInputs,
        x: torch.Tensor,  # [num_tokens, hidden]
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        kv_cache: KVCache,
        x_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, heads, rope + lora], x + residual)
        """Norm, the low-rank projections, rotary on the query's and the key's rotary dims, this
        step's [k_pe | c_kv] rows into the cache; returns each head's query in the cache's
        space, [q_pe | q_nope @ W_UK]."""
        ops = step.ops
        a, summed = norm_then_project(
            ops, self.qkv_a_proj, x, residual, norm_weight, eps, x_norm_weight
        )
        q_width = a.shape[-1] - self.lora - self.rope
        q = a[:, :q_width]
        if self.q_b_proj is not None:
            assert self.q_a_layernorm is not None
            q_normed = ops.rms_norm(q.contiguous(), self.q_a_layernorm, LATENT_NORM_EPS)
            q = self.q_b_proj(ops, q_normed)
        q = q.reshape(-1, self.num_heads, self.nope + self.rope)
        latent = ops.rms_norm(
            a[:, q_width : q_width + self.lora].contiguous(), self.kv_a_layernorm, LATENT_NORM_EPS
        )
        k_pe = a[:, q_width + self.lora :].unsqueeze(1)  # [num_tokens, 1, rope]
        q_pe, k_pe = reference.rotary_embedding(
            step.positions, q[..., self.nope :], k_pe, step.cos_sin_cache
        )
        w_uk, _ = self._absorbed()
        q_latent = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_pe, q_latent], dim=-1)
        key = torch.cat([k_pe, latent.unsqueeze(1)], dim=-1)  # [num_tokens, 1, rope + lora]
        k_cache, v_cache = kv_cache
        ops.rotary_embedding_write_kv(
            torch.zeros_like(step.positions), key, key, key, self.identity_rope, k_cache,
            v_cache, step.metadata.slot_mapping,
        )  # fmt: skip
        return query, summed

    def attend(self, step: StepInputs, query: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Multi-query attention over the cached rows, the latent columns of its output through
        W_UV per head, then o_proj: [num_tokens, hidden] (summed over TP ranks)."""
        _, w_uv = self._absorbed()
        latent = self._attend_latent(step, query, kv_cache).transpose(0, 1)  # [heads, n, lora]
        values = torch.bmm(latent, w_uv.transpose(1, 2)).transpose(0, 1)
        return self.o_proj(step.ops, values.reshape(-1, self.num_heads * self.v_dim))

    def _attend_latent(
        self, step: StepInputs, query: torch.Tensor, kv_cache: KVCache
    ) -> torch.Tensor:  # [num_tokens, heads, lora]: each head's attended latent
        """Decodes through ops.mla_decode_attention (each row read once, any number of heads,
        over a 16- or 32-bit or a float8 cache), prefill chunks through the backend's kernels
        (the rows as K and V, their rotary columns of the output dropped)."""
        m, cache = step.metadata, kv_cache[0]
        nd = m.num_decodes
        if nd == 0 or self.kind != FULL_ATTENTION:
            out = step.backend.forward(query, cache, kv_cache[1], m, self.scale, self.kind)
            return out[..., self.rope :]
        decoded = step.ops.mla_decode_attention(
            query[:nd], cache, m.block_tables[:nd], m.seq_lens[:nd], self.scale, m.max_seq_len,
            self.rope,
        )  # fmt: skip
        if nd == m.num_seqs:
            return decoded
        prefill = dataclasses.replace(
            m,
            query_start_loc=m.query_start_loc[nd:] - nd,
            seq_lens=aligned(m.seq_lens[nd:]),  # see run_split_attention
            block_tables=aligned(m.block_tables[nd:]),
            num_decodes=0,
        )
        out = step.backend.forward(query[nd:], cache, kv_cache[1], prefill, self.scale, self.kind)
        return torch.cat([decoded, out[..., self.rope :]])
