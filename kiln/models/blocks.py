"""The blocks decoder families share: rotary attention (optionally with a per-head q/k RMSNorm),
a gated MLP, and the decoder layer that runs them. Each block picks the fused kernels of `ops`
that fit its shape and takes their weights and scales from its projections' linear methods
(`fused_operands`, `fp8_input`); where a method offers none, the block composes the norm, the
method's own `apply` and its epilogue."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kiln.attention.backend import (
    FULL_ATTENTION,
    AttentionBackend,
    AttentionKind,
    AttentionMetadata,
)
from kiln.distributed.parallel_state import ParallelContext, kv_head_range
from kiln.kernels import reference
from kiln.kernels.reference import split_qkv_heads
from kiln.layers.linear import Linear, LinearMethod, TensorSplit
from kiln.models.config import ModelConfig

if TYPE_CHECKING:
    from kiln.models.base import CausalLM

# A layer's qualified name (e.g. "layers.3.self_attn.qkv_proj") -> its LinearMethod.
LinearMethodFactory = Callable[[str], LinearMethod]
KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class StepInputs:
    """What every layer of one forward shares."""

    ops: ModuleType
    backend: AttentionBackend
    positions: torch.Tensor  # [num_tokens] int64
    cos_sin_cache: torch.Tensor  # [max_positions, rotary_dim] fp32
    metadata: AttentionMetadata
    # The model's other rotary tables by name (Gemma 3's local layers' base): an attention
    # made with rope_table=name rotates by its table, indexed by `positions` too.
    rope_tables: Mapping[str, torch.Tensor] = field(default_factory=dict)


def norm_then_project(
    ops: ModuleType,
    layer: Linear,
    x: torch.Tensor,  # [num_tokens, K]
    residual: torch.Tensor | None,  # [num_tokens, K], or None: no residual to add
    norm_weight: torch.Tensor | None,
    eps: float,
    x_norm_weight: torch.Tensor | None = None,  # [K]: x RMS-normed by it before the add
    norm_bias: torch.Tensor | None = None,  # [K]: the LayerNorm's bias
    layer_norm: bool = False,  # the norm is a LayerNorm (reference.layer_norm)
) -> tuple[torch.Tensor, torch.Tensor]:  # (layer(rms_norm(x + residual)), x + residual)
    """A column-parallel projection of the normed stream in the fewest kernels its method
    allows: one fused op given its operands; else, for a method taking float8 (int8) input,
    the norm that quantizes, then apply_fp8 (apply_int8); else the norm, then apply.
    `norm_weight` None: no norm (OLMo 2's blocks read the stream itself; parallel blocks one
    norm made before). `x_norm_weight`: x joins the stream RMS-normed by it (a sandwich layer's
    block output, reference.sandwich_input), inside the same kernels. `layer_norm`: the norm
    kernels' LayerNorm flavour (with `norm_bias`); the one-row norm + projection kernels take
    RMSNorm only (they scale the dot product by its one scalar a row), so a LayerNorm runs as
    its own fused add + norm (or quantizing norm) kernel before the projection."""
    if norm_weight is None:
        x = x if x_norm_weight is None else ops.rms_norm(x, x_norm_weight, eps)
        summed = x if residual is None else x + residual
        return layer(ops, summed), summed
    # The flavour's arguments only when set: the RMSNorm calls stay as they were.
    flavour: dict[str, object] = {"bias": norm_bias, "layer_norm": True} if layer_norm else {}
    operands = None if layer_norm else layer.method.fused_operands(layer)
    if operands is not None:
        return ops.add_rms_norm_linear(
            x, residual, norm_weight, eps, *operands, x_norm_weight=x_norm_weight
        )
    into = layer.method.fp8_input(layer)
    if into is not None:
        rows = x.reshape(-1, x.shape[-1])
        x_fp8, scale, summed = ops.add_rms_norm_quant_fp8(
            rows, None if residual is None else residual.reshape(rows.shape), norm_weight, eps,
            into.static_scale, into.channels, x_norm_weight=x_norm_weight, **flavour,
        )  # fmt: skip
        y = layer.apply_fp8(ops, x_fp8, scale, x.dtype)
        return y.reshape(*x.shape[:-1], layer.out_features), summed.reshape(x.shape)
    if layer.method.int8_input(layer):  # W8A8 INT8: the norm writes int8 rows and scales
        x = x if x_norm_weight is None else ops.rms_norm(x, x_norm_weight, eps)
        rows = x.reshape(-1, x.shape[-1])
        x_int8, scale, summed = ops.add_rms_norm_quant_int8(
            rows, None if residual is None else residual.reshape(rows.shape), norm_weight, eps,
            **flavour,
        )  # fmt: skip
        y = layer.apply_int8(ops, x_int8, scale, x.dtype)
        return y.reshape(*x.shape[:-1], layer.out_features), summed.reshape(x.shape)
    if residual is None:
        x = x if x_norm_weight is None else ops.rms_norm(x, x_norm_weight, eps)
        normed, summed = ops.rms_norm(x, norm_weight, eps, **flavour), x
    else:
        normed, summed = ops.fused_add_rms_norm(
            x, residual, norm_weight, eps, x_norm_weight, **flavour
        )
    return layer(ops, normed), summed


class RopeAttention(nn.Module):
    """Rotary multi-head attention with grouped KV heads: a fused qkv projection, rotary
    embedding, the paged KV cache and o_proj. `qk_norm`: each query and key head is
    RMS-normed (its own [head_dim] weights, `q_norm` / `k_norm`) before rotary (Qwen3);
    `qk_norm="full"`: the whole query and the whole key projection are, each with its own
    [heads * head_dim] weights (OLMo 2); `qk_norm="head_layer"`: each query and key head is
    LayerNormed (no bias) with weights of its own, [heads, head_dim] (Cohere's use_qk_norm,
    StableLM 2 12B's qk_layernorm). Rotary turns the first `cfg.rotary_dim` dims of each
    head (partial rotary passes the rest), by `rope_table` (a name of StepInputs.rope_tables)
    or the model's table. Biases: `cfg.attention_bias` on q/k/v, `cfg.o_proj_bias` on o_proj;
    the query scale is `cfg.attention_multiplier` when the family gives one.
    `kind`: the layer's window and soft-cap (the decoder sets it from the config's layer kinds);
    `sinks`: a learned per-head logit in each softmax's denominator (gpt-oss), [num_heads]."""

    kind: AttentionKind = FULL_ATTENTION
    # (k_scale, v_scale, whether the k rows hold 1 / k_scale) once fold_kv_scales ran.
    folded_kv_scales: tuple[float, float, bool] | None = None
    # This rank's (k scales, v scales), one per KV head, once fold_kv_head_scales ran.
    folded_kv_head_scales: tuple[list[float], list[float]] | None = None
    kv_head_start: int = 0  # the first KV head of this rank's (tensor parallel) share
    q_head_start: int = 0  # ... and its first query head

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
        full: ModelConfig | None = None,
        qk_norm: bool | str = False,
        rope_table: str | None = None,
        sinks: bool = False,
    ) -> None:
        super().__init__()
        # cfg is this rank's shard (shard_config); `full` the whole model's, under TP.
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.rope_table = rope_table
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        multiplier = cfg.attention_multiplier
        self.scale = self.head_dim**-0.5 if multiplier is None else multiplier
        self.eps = cfg.rms_norm_eps
        self.full_qk_norm = qk_norm == "full"
        self.head_layer_norm = qk_norm == "head_layer"
        if self.full_qk_norm and ctx is not None and ctx.tp_size > 1:
            raise ValueError("a q/k norm over the whole projection does not split over TP ranks")
        qkv_split = o_split = None
        if ctx is not None and ctx.tp_size > 1:
            # Query heads split evenly; KV heads split, or replicated when fewer than ranks.
            assert full is not None, "under TP the layer is also given the whole model's config"
            hd, r = self.head_dim, ctx.tp_rank
            kv_start, _ = kv_head_range(full.num_key_value_heads, ctx.tp_size, r)
            self.kv_head_start, self.q_head_start = kv_start, r * self.num_heads
            q_full, kv_full = full.num_attention_heads * hd, full.num_key_value_heads * hd
            kv_rows = (kv_start * hd, self.kv_size)
            qkv_split = TensorSplit(
                ctx,
                rows=((r * self.q_size, self.q_size), kv_rows, kv_rows),
                full_sizes=(q_full, kv_full, kv_full),
            )
            o_split = TensorSplit(ctx, cols=(r * self.q_size, self.q_size))
        self.qkv_proj = Linear(
            cfg.hidden_size,
            self.q_size + 2 * self.kv_size,
            bias=cfg.attention_bias,
            output_sizes=[self.q_size, self.kv_size, self.kv_size],
            method=method(f"{prefix}.qkv_proj"),
            dtype=dtype,
            split=qkv_split,
        )
        self.o_proj = Linear(
            self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, method=method(f"{prefix}.o_proj"),
            dtype=dtype, split=o_split,
        )  # fmt: skip
        self.q_norm: nn.Parameter | None = None
        self.k_norm: nn.Parameter | None = None
        if qk_norm:
            q_width, k_width = self.head_dim, self.head_dim
            if self.full_qk_norm:
                q_width, k_width = self.q_size, self.kv_size
            q_shape: tuple[int, ...] = (q_width,)
            k_shape: tuple[int, ...] = (k_width,)
            if self.head_layer_norm:  # this rank's heads' (cut at load: kiln.models.layer_norm)
                q_shape, k_shape = (self.num_heads, q_width), (self.num_kv_heads, k_width)
            self.q_norm = nn.Parameter(torch.ones(q_shape, dtype=dtype))
            self.k_norm = nn.Parameter(torch.ones(k_shape, dtype=dtype))
        # fp32 whatever the model's dtype: the kernels add them to fp32 scores. One per query
        # head of this rank (cut_sinks: under TP the rank's heads' of the whole model's).
        self.sinks: nn.Parameter | None = None
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads, dtype=torch.float32))

    def cut_sinks(self, sinks: torch.Tensor) -> torch.Tensor:
        """This tensor rank's query heads' sinks of the whole model's [num_heads] (itself at
        TP=1): each head's softmax takes its own sink, so they split as the heads do."""
        if self.o_proj.split is None:
            return sinks
        return sinks.narrow(0, self.q_head_start, self.num_heads)

    def project_qkv(
        self,
        step: StepInputs,
        x: torch.Tensor,  # [num_tokens, hidden]: the last block's output
        residual: torch.Tensor | None,  # the residual stream; None before the first layer
        norm_weight: torch.Tensor | None,  # None: no norm before the projection
        eps: float,
        kv_cache: KVCache,
        x_norm_weight: torch.Tensor | None = None,  # x RMS-normed by it before the add
        norm_bias: torch.Tensor | None = None,  # norm_then_project's LayerNorm flavour
        layer_norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([num_tokens, heads, head_dim], x + residual)
        """The attention block up to attending: norm, qkv projection, (q/k norm,) rotary, and
        this step's keys and values into the cache. Returns the rotated query. `x_norm_weight`,
        `norm_bias`, `layer_norm`: norm_then_project's (the layer before's output norm, folded
        into this entry; the LayerNorm flavour)."""
        ops, (k_cache, v_cache) = step.ops, kv_cache
        slots = step.metadata.slot_mapping
        table = step.cos_sin_cache if self.rope_table is None else step.rope_tables[self.rope_table]
        if self.full_qk_norm:
            return self._project_qkv_composed(
                step, x, residual, norm_weight, eps, kv_cache, table, x_norm_weight
            )
        one_row = norm_weight is not None and not layer_norm and self.rotary_dim == self.head_dim
        operands = self.qkv_proj.method.fused_operands(self.qkv_proj) if one_row else None
        if operands is not None and self.k_norm is None:
            # One kernel at batch-1 decode on the GPU, where a step is mostly launch-bound.
            weight, bias, weight_scale, input_scale = operands
            return ops.add_rms_norm_qkv_rotary_write_kv(
                x, residual, norm_weight, eps, weight, bias, step.positions, table,
                k_cache, v_cache, slots, weight_scale, input_scale, x_norm_weight=x_norm_weight,
            )  # fmt: skip
        qkv, summed = norm_then_project(
            ops, self.qkv_proj, x, residual, norm_weight, eps, x_norm_weight, norm_bias, layer_norm
        )
        if self.k_norm is not None:  # per head: RMSNorm (Qwen3) or LayerNorm (Cohere, StableLM)
            flavour = {"layer_norm": True} if self.head_layer_norm else {}
            query = ops.qk_norm_rotary_write_kv(
                qkv, self.q_norm, self.k_norm, self.eps, step.positions, table,
                k_cache, v_cache, slots, **flavour,
            )  # fmt: skip
            return query, summed
        query, key, value = split_qkv_heads(qkv, self.head_dim, self.num_kv_heads)
        query = ops.rotary_embedding_write_kv(
            step.positions, query, key, value, table, k_cache, v_cache, slots
        )
        return query, summed

    def _project_qkv_composed(
        self,
        step: StepInputs,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        kv_cache: KVCache,
        table: torch.Tensor,  # [max_positions, rotary_dim]
        x_norm_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """project_qkv for a q/k norm over the whole projection (OLMo 2), which the fused q/k
        op does not take: the projection, the norms by `ops.rms_norm` (a row per token), then
        the rotary + cache-write op, which turns the table's dims only."""
        ops = step.ops
        qkv, summed = norm_then_project(
            ops, self.qkv_proj, x, residual, norm_weight, eps, x_norm_weight
        )
        query, key, value = split_qkv_heads(qkv, self.head_dim, self.num_kv_heads)
        if self.q_norm is not None and self.k_norm is not None:
            q_shape, k_shape = query.shape, key.shape
            query = ops.rms_norm(query.reshape(q_shape[0], -1), self.q_norm, self.eps)
            key = ops.rms_norm(key.reshape(k_shape[0], -1), self.k_norm, self.eps)
            query, key = query.reshape(q_shape), key.reshape(k_shape)
        query = ops.rotary_embedding_write_kv(
            step.positions, query, key, value, table, kv_cache[0], kv_cache[1],
            step.metadata.slot_mapping,
        )  # fmt: skip
        return query, summed

    def cache_keys_values(
        self,
        qkv: torch.Tensor,  # [num_tokens, q_size + 2 * kv_size]: qkv_proj's output
    ) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_tokens, kv_heads, head_dim]
        """The keys (before rotary) and values this block writes to the cache for `qkv`, by
        the reference ops: what KV-cache calibration measures."""
        _, key, value = split_qkv_heads(qkv, self.head_dim, self.num_kv_heads)
        if self.head_layer_norm:
            assert self.k_norm is not None
            key = reference.head_layer_norm(key, self.k_norm, self.eps)
        elif self.k_norm is not None:
            shape = key.shape
            flat = key.reshape(shape[0], -1) if self.full_qk_norm else key
            key = reference.rms_norm(flat, self.k_norm, self.eps).reshape(shape)
        return key, value

    @torch.no_grad()
    def fold_kv_scales(self, k_scale: float, v_scale: float, into_weights: bool = True) -> None:
        """Write k / k_scale and v / v_scale to the cache and attend as before (see
        kiln.models.kv_scales): keys through the k rows of qkv_proj, or through k_norm's weight
        when a k-norm follows them (it would undo a scale folded into the rows); values through
        the v rows and o_proj. `into_weights=False`: the weights hold them already."""
        self.scale *= k_scale
        # What a LoRA adapter's k, v and o_proj outputs are scaled by to match (kiln.lora.model).
        self.folded_kv_scales = (k_scale, v_scale, self.k_norm is None)
        if not into_weights:
            return
        q, kv = self.q_size, self.kv_size
        if self.k_norm is None:
            self.qkv_proj.scale_output_rows(slice(q, q + kv), 1.0 / k_scale)
        else:
            self.k_norm.mul_(1.0 / k_scale)
        self.qkv_proj.scale_output_rows(slice(q + kv, q + 2 * kv), 1.0 / v_scale)
        self.o_proj.scale_output_rows(slice(None), v_scale, bias=False)  # W (v_stored * s) + b
        input_scale = getattr(self.o_proj, "input_scale", None)
        if input_scale is not None:
            input_scale.div_(v_scale)  # its static scale saw the unscaled inputs

    @torch.no_grad()
    def fold_kv_head_scales(
        self, k_scales: Sequence[float], v_scales: Sequence[float], into_weights: bool = True
    ) -> tuple[list[float], list[float]]:
        """fold_kv_scales with a scale per KV head (`k_scales`, `v_scales`: the whole model's
        heads; this rank takes its own): head h's keys are k / k_h through its k rows, and its
        group's query rows times k_h undo it in q . k; its values are v / v_h through its v
        rows, and o_proj's input columns of its group times v_h undo it. Where a q/k norm
        follows the rows (it would undo a row scale), the keys take the layer's largest k_h
        through k_norm and the softmax scale; where o_proj's weights are quantized (their
        columns hold codes), the values take the layer's largest v_h through o_proj's rows.
        Returns the scales this rank's heads hold after those choices (per head, in order)."""
        n, start = self.num_kv_heads, self.kv_head_start
        ks, vs = list(k_scales[start : start + n]), list(v_scales[start : start + n])
        if len(ks) != n or len(vs) != n:
            raise ValueError(f"{len(k_scales)} KV-head scales for KV heads {start}..{start + n}")
        per_head_k = self.k_norm is None and self.q_norm is None
        per_head_v = _plain_weight(self.o_proj)
        if not per_head_k:
            ks = [max(ks)] * n
            self.scale *= ks[0]
        if not per_head_v:
            vs = [max(vs)] * n
        self.folded_kv_head_scales = (ks, vs)
        if not into_weights:
            return ks, vs
        q, kv, hd = self.q_size, self.kv_size, self.head_dim
        group = self.num_heads // n
        for h in range(n):
            if per_head_k:
                self.qkv_proj.scale_output_rows(slice(h * group * hd, (h + 1) * group * hd), ks[h])
                self.qkv_proj.scale_output_rows(slice(q + h * hd, q + (h + 1) * hd), 1.0 / ks[h])
            rows = slice(q + kv + h * hd, q + kv + (h + 1) * hd)
            self.qkv_proj.scale_output_rows(rows, 1.0 / vs[h])
            if per_head_v:
                self.o_proj.weight[:, h * group * hd : (h + 1) * group * hd] *= vs[h]
        if not per_head_k:
            assert self.k_norm is not None
            self.k_norm.mul_(1.0 / ks[0])
        if not per_head_v:
            self.o_proj.scale_output_rows(slice(None), vs[0], bias=False)
            input_scale = getattr(self.o_proj, "input_scale", None)
            if input_scale is not None:
                input_scale.div_(vs[0])  # its static scale saw the unscaled inputs
        return ks, vs

    def attend(self, step: StepInputs, query: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        """Attention over the cache, then o_proj: [num_tokens, hidden] (summed over TP ranks)."""
        out = step.backend.forward(
            query, kv_cache[0], kv_cache[1], step.metadata, self.scale, self.kind, self.sinks
        )
        return self.o_proj(step.ops, out.reshape(-1, self.q_size))


def _plain_weight(proj: Linear) -> bool:
    """Whether `proj` multiplies by its weight as stored, in a float dtype of 16 bits or more
    (so scaling its columns scales its inputs exactly)."""
    weight = getattr(proj, "weight", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and getattr(proj, "weight_scale", None) is None
        and getattr(proj, "weight_scales", None) is None
    )


def gated_mlp(
    ops: ModuleType,
    gate_up: Linear,
    down: Linear,
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    eps: float,
    activation: str = "silu",
    x_norm_weight: torch.Tensor | None = None,  # [hidden]: x RMS-normed by it before the add
    norm_bias: torch.Tensor | None = None,  # norm_then_project's LayerNorm flavour
    layer_norm: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (down(act(gate) * up), x + residual)
    """The MLP block from its norm through `down`. When down takes float8 input (FP8 W8A8) or
    int8 input (W8A8 INT8), the activation reaches it quantized by the activation-mul's own
    kernel: no model-dtype activation written and re-read, no quantize kernel of its own.
    `activation`: "silu", or "gelu_pytorch_tanh" (GeGLU), an argument of the same fused kernels.
    `x_norm_weight`: norm_then_project's (a sandwich layer's post-attention norm, folded into
    this entry); `norm_bias`, `layer_norm` too (a LayerNorm: its own kernel, as there)."""
    into = down.method.fp8_input(down)
    operands = gate_up.method.fused_operands(gate_up)
    # The operands the fused kernels take (they take no bias), else None.
    fusable = operands is not None and operands.bias is None and norm_weight is not None
    fusable = fusable and not layer_norm  # the one-row kernels' norm is RMSNorm
    fused = operands if fusable else None
    scale = None
    if (
        into is not None
        and fused is not None
        and fused.weight_scale is not None
        and into.channels is None
    ):
        activation_out, scale, summed = ops.add_rms_norm_linear_silu_mul_fp8(
            x, residual, norm_weight, eps, fused.weight, fused.weight_scale,
            fused.input_scale, into.static_scale, activation, x_norm_weight,
        )  # fmt: skip
    elif fused is not None:
        activation_out, summed = ops.add_rms_norm_linear_silu_mul(
            x, residual, norm_weight, eps, fused.weight, fused.weight_scale,
            fused.input_scale, activation, x_norm_weight,
        )  # fmt: skip
    else:
        gate_up_out, summed = norm_then_project(
            ops, gate_up, x, residual, norm_weight, eps, x_norm_weight, norm_bias, layer_norm
        )
        silu = activation == "silu"
        if into is not None and operands is None:  # a composed projection: quantize here too
            quant = ops.silu_and_mul_quant_fp8 if silu else ops.gelu_tanh_and_mul_quant_fp8
            act, scale = quant(gate_up_out, into.static_scale, into.channels)
        elif down.method.int8_input(down):  # W8A8 INT8: the activation writes int8 rows
            quant = ops.silu_and_mul_quant_int8 if silu else ops.gelu_tanh_and_mul_quant_int8
            act_int8, act_scale = quant(gate_up_out)
            return down.apply_int8(ops, act_int8, act_scale, x.dtype), summed
        else:
            act = (ops.silu_and_mul if silu else ops.gelu_tanh_and_mul)(gate_up_out)
        activation_out = act
    if scale is None:  # model dtype (the GPU's small-batch rows quantize inside down's kernel)
        return down(ops, activation_out), summed
    return down.apply_fp8(ops, activation_out, scale, x.dtype), summed


def _mlp_splits(
    ctx: ParallelContext | None, n: int, parts: int
) -> tuple[TensorSplit | None, TensorSplit | None]:
    """An MLP's tensor-parallel cuts: this rank's `n` rows of each of the up projection's
    `parts` (gate, up), and the same `n` columns of the down projection; None at TP=1."""
    if ctx is None or ctx.tp_size == 1:
        return None, None
    rows = (ctx.tp_rank * n, n)
    up = TensorSplit(ctx, rows=(rows,) * parts, full_sizes=(n * ctx.tp_size,) * parts)
    return up, TensorSplit(ctx, cols=rows)


class GatedMLP(nn.Module):
    """down(act(gate) * up), gate and up fused into one projection ([gate; up] rows); biases
    on all three with `cfg.mlp_bias`."""

    ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # those the kernels of `ops` compute

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
        activation: str | None = None,  # None: cfg.hidden_act
    ) -> None:
        super().__init__()
        activation = activation or cfg.hidden_act
        if activation not in self.ACTIVATIONS:
            raise ValueError(f"no kernels for a gated MLP of {activation!r}: {self.ACTIVATIONS}")
        self.activation = activation
        self.intermediate_size = n = cfg.intermediate_size  # this rank's share under TP
        gate_up_split, down_split = _mlp_splits(ctx, n, parts=2)
        self.gate_up_proj = Linear(
            cfg.hidden_size, 2 * n, bias=cfg.mlp_bias, output_sizes=[n, n],
            method=method(f"{prefix}.gate_up_proj"), dtype=dtype, split=gate_up_split,
        )  # fmt: skip
        self.down_proj = Linear(
            n, cfg.hidden_size, bias=cfg.mlp_bias, method=method(f"{prefix}.down_proj"),
            dtype=dtype, split=down_split,
        )  # fmt: skip

    def forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        x_norm_weight: torch.Tensor | None = None,  # x RMS-normed by it before the add
        norm_bias: torch.Tensor | None = None,  # norm_then_project's LayerNorm flavour
        layer_norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the MLP's output, x + residual)
        return gated_mlp(
            ops, self.gate_up_proj, self.down_proj, x, residual, norm_weight, eps,
            self.activation, x_norm_weight, norm_bias, layer_norm,
        )  # fmt: skip


class PlainMLP(nn.Module):
    """c_proj(act(c_fc(x))): the ungated MLP (Starcoder2), biases on both with `cfg.mlp_bias`;
    the same call as GatedMLP. Its activation runs as torch's (no fused kernel: one family)."""

    # hidden_act -> F.gelu's `approximate`
    ACTIVATIONS: ClassVar[dict[str, str]] = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        if cfg.hidden_act not in self.ACTIVATIONS:
            raise ValueError(f"no ungated MLP of {cfg.hidden_act!r}: {list(self.ACTIVATIONS)}")
        self.approximate = self.ACTIVATIONS[cfg.hidden_act]
        n = cfg.intermediate_size  # this rank's share under TP
        fc_split, proj_split = _mlp_splits(ctx, n, parts=1)
        self.c_fc = Linear(
            cfg.hidden_size, n, bias=cfg.mlp_bias, method=method(f"{prefix}.c_fc"), dtype=dtype,
            split=fc_split,
        )  # fmt: skip
        self.c_proj = Linear(
            n, cfg.hidden_size, bias=cfg.mlp_bias, method=method(f"{prefix}.c_proj"),
            dtype=dtype, split=proj_split,
        )  # fmt: skip

    def forward(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        x_norm_weight: torch.Tensor | None = None,  # x RMS-normed by it before the add
        norm_bias: torch.Tensor | None = None,  # norm_then_project's LayerNorm flavour
        layer_norm: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (the MLP's output, x + residual)
        up, summed = norm_then_project(
            ops, self.c_fc, x, residual, norm_weight, eps, x_norm_weight, norm_bias, layer_norm
        )
        return self.c_proj(ops, F.gelu(up, approximate=self.approximate)), summed


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer: x + attention(norm(x)), then + mlp(norm(...)), with the residual
    add of each block fused into the norm of the next.

    `norms` picks where the layer norms: "pre" (Llama: input_layernorm before attention,
    post_attention_layernorm before the MLP); "sandwich" (Gemma 2/3: also each block's output
    normed before its residual add, post_attention_layernorm after attention,
    pre_feedforward_layernorm and post_feedforward_layernorm around the MLP; each of those
    output norms runs inside the next fused add + norm entry, `x_norm_weight`: the MLP's for
    post_attention_layernorm, and for post_feedforward_layernorm the next layer's attention
    or the final norm, so the layer returns its MLP's output unnormed and names the norm its
    reader applies, `output_norm`); "post" (OLMo 2:
    the blocks read the stream unnormed, their outputs normed by post_attention_layernorm and
    post_feedforward_layernorm). `qk_norm`, `rope_table`, `sinks`: RopeAttention's.

    `layer_norm`: LayerNorms (the norm kernels' LayerNorm flavour, biases `*_bias` with
    `norm_bias`: StableLM, Cohere, Starcoder2) before the blocks, in place of the RMSNorms;
    with `parallel` attention and MLP read the same normed input (input_layernorm, the only
    norm) and their outputs join the stream together (Cohere, StableLM use_parallel_residual).
    `mlp`: a block in place of the gated MLP, with its call (kiln.models.moe_blocks.SparseMoeBlock);
    `attention`: one in place of RopeAttention, with its project_qkv / attend / kind
    (kiln.models.mla.LatentAttention)."""

    NORMS = ("pre", "sandwich", "post")

    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
        full: ModelConfig | None = None,
        qk_norm: bool | str = False,
        norms: str = "pre",
        rope_table: str | None = None,
        layer_norm: bool = False,
        norm_bias: bool = False,
        parallel: bool = False,
        gated_mlp: bool = True,
        mlp: nn.Module | None = None,
        sinks: bool = False,
        attention: RopeAttention | None = None,
    ) -> None:
        super().__init__()
        if norms not in self.NORMS:
            raise ValueError(f"unknown norm placement {norms!r}; known: {self.NORMS}")
        if (layer_norm or parallel) and norms != "pre":
            raise ValueError("LayerNorm and parallel layers place their norms before the blocks")
        self.eps = cfg.rms_norm_eps
        self.norms = norms
        self.layer_norm, self.parallel = layer_norm, parallel
        if attention is None:
            attention = RopeAttention(
                cfg, f"{prefix}.self_attn", method, dtype, ctx, full, qk_norm, rope_table, sinks
            )
        self.self_attn = attention
        self.mlp: GatedMLP | PlainMLP | nn.Module
        if mlp is not None:  # the family's own block, called as GatedMLP is (MoE)
            self.mlp = mlp
        elif gated_mlp:
            self.mlp = GatedMLP(cfg, f"{prefix}.mlp", method, dtype, ctx)
        else:  # `gated_mlp=False`: PlainMLP (Starcoder2)
            self.mlp = PlainMLP(cfg, f"{prefix}.mlp", method, dtype, ctx)

        def norm() -> nn.Parameter:
            return nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))

        if norms != "post":
            self.input_layernorm = norm()
        if not parallel:
            self.post_attention_layernorm = norm()
        self.input_layernorm_bias: nn.Parameter | None = None
        self.post_attention_layernorm_bias: nn.Parameter | None = None
        if norm_bias:
            self.input_layernorm_bias = nn.Parameter(torch.zeros(cfg.hidden_size, dtype=dtype))
            if not parallel:
                self.post_attention_layernorm_bias = nn.Parameter(
                    torch.zeros(cfg.hidden_size, dtype=dtype)
                )
        if norms == "sandwich":
            self.pre_feedforward_layernorm = norm()
        if norms != "pre":
            self.post_feedforward_layernorm = norm()

    def forward(
        self,
        step: StepInputs,
        hidden: torch.Tensor,  # [num_tokens, hidden]: the last layer's output (or the embedding)
        residual: torch.Tensor | None,  # the residual stream; None before the first layer
        kv_cache: KVCache,
        tap: Callable[[torch.Tensor], None] | None = None,
        hidden_norm: torch.Tensor | None = None,  # the layer before's output_norm
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this layer's output, the residual stream)
        """`tap`, if given, sees the residual stream entering this layer (EAGLE-3's input).
        `hidden_norm`: `hidden` joins the stream RMS-normed by it (the layer before's
        output_norm, which its reader must apply). Returns the output unnormed by
        `self.output_norm`."""
        attn, ops = self.self_attn, step.ops
        if hidden_norm is not None and self.norms != "sandwich":
            hidden = ops.rms_norm(hidden, hidden_norm, self.eps)  # not a sandwich pair
            hidden_norm = None
        if self.layer_norm:
            return self._forward_layer_norm(step, hidden, residual, kv_cache, tap)
        if self.norms == "pre":
            query, residual = attn.project_qkv(
                step, hidden, residual, self.input_layernorm, self.eps, kv_cache
            )
            if tap is not None:
                tap(residual)
            hidden = attn.attend(step, query, kv_cache)
            return self.mlp(ops, hidden, residual, self.post_attention_layernorm, self.eps)
        if self.norms == "sandwich":
            return self._forward_sandwich(step, hidden, residual, kv_cache, tap, hidden_norm)
        query, residual = attn.project_qkv(step, hidden, residual, None, self.eps, kv_cache)
        if tap is not None:
            tap(residual)
        hidden = ops.rms_norm(attn.attend(step, query, kv_cache), self.post_attention_layernorm,
                              self.eps)  # fmt: skip
        hidden, residual = self.mlp(ops, hidden, residual, None, self.eps)
        return ops.rms_norm(hidden, self.post_feedforward_layernorm, self.eps), residual

    @property
    def output_norm(self) -> torch.Tensor | None:
        """The RMSNorm weight the reader of this layer's output applies to it before adding it
        to the stream (a sandwich layer's post_feedforward_layernorm: the next layer's `forward`
        takes it as `hidden_norm`, the final norm as its own); None: the output as it is."""
        if self.norms != "sandwich":
            return None
        weight: torch.Tensor = self.post_feedforward_layernorm
        return weight

    def _forward_sandwich(
        self,
        step: StepInputs,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        tap: Callable[[torch.Tensor], None] | None,
        hidden_norm: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with sandwich norms: each block's output norm folded into the next entry
        (at batch-1 decode, two RMSNorm launches fewer a layer)."""
        attn, ops = self.self_attn, step.ops
        query, residual = attn.project_qkv(
            step, hidden, residual, self.input_layernorm, self.eps, kv_cache, hidden_norm
        )
        if tap is not None:
            tap(residual)
        attended = attn.attend(step, query, kv_cache)
        if isinstance(self.mlp, (GatedMLP, PlainMLP)):
            return self.mlp(
                ops, attended, residual, self.pre_feedforward_layernorm, self.eps,
                self.post_attention_layernorm,
            )  # fmt: skip
        # A block of another call (MoE): the post-attention norm as its own kernel.
        attended = ops.rms_norm(attended, self.post_attention_layernorm, self.eps)
        out: tuple[torch.Tensor, torch.Tensor] = self.mlp(
            ops, attended, residual, self.pre_feedforward_layernorm, self.eps
        )
        return out

    def _forward_layer_norm(
        self,
        step: StepInputs,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        tap: Callable[[torch.Tensor], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """forward with LayerNorms: the norm kernels' LayerNorm flavour, each residual add fused
        into the norm after it, and quantizing where the projection takes float8 (int8) input.
        Parallel blocks read one norm; where a projection quantizes its input, the MLP's
        quantizing norm reads the stream again (as its own entry, the same normed values)."""
        attn, ops, eps = self.self_attn, step.ops, self.eps
        weight, bias = self.input_layernorm, self.input_layernorm_bias
        mlp = self.mlp
        assert isinstance(mlp, (GatedMLP, PlainMLP)), "LayerNorm layers run the shared MLPs"
        first = mlp.gate_up_proj if isinstance(mlp, GatedMLP) else mlp.c_fc
        if self.parallel and not (_quantized_input(attn.qkv_proj) or _quantized_input(first)):
            if residual is None:
                normed, summed = ops.rms_norm(hidden, weight, eps, bias, True), hidden
            else:
                normed, summed = ops.fused_add_rms_norm(hidden, residual, weight, eps, None,
                                                        bias, True)  # fmt: skip
            if tap is not None:
                tap(summed)
            query, _ = attn.project_qkv(step, normed, None, None, eps, kv_cache)
            attended = attn.attend(step, query, kv_cache)
            mlp_out, _ = mlp(ops, normed, None, None, eps)
            return attended + mlp_out, summed
        query, summed = attn.project_qkv(
            step, hidden, residual, weight, eps, kv_cache, None, bias, True
        )
        if tap is not None:
            tap(summed)
        attended = attn.attend(step, query, kv_cache)
        if self.parallel:
            mlp_out, _ = mlp(ops, summed, None, weight, eps, None, bias, True)
            return attended + mlp_out, summed
        return mlp(ops, attended, summed, self.post_attention_layernorm, eps, None,
                   self.post_attention_layernorm_bias, True)  # fmt: skip


def _quantized_input(layer: Linear) -> bool:
    """Whether `layer` reads float8 or int8 rows from the norm before it (FP8 W8A8, W8A8
    INT8): its own quantizing norm entry, not a shared model-dtype norm."""
    return layer.method.fp8_input(layer) is not None or layer.method.int8_input(layer)


def decoder_layers(model: CausalLM) -> list[DecoderLayer]:
    """The model's decoder layers, as the shared blocks that build-time calibration walks (their
    projections, attention and MLP); a family with other blocks is refused here, by name."""
    layers = []
    for layer in model.layers:
        if not isinstance(layer, DecoderLayer):
            raise TypeError(f"calibration walks DecoderLayer blocks, not {type(layer).__name__}")
        if not isinstance(layer.self_attn, RopeAttention):  # MLA (kiln.models.mla)
            raise TypeError(
                f"calibration walks RopeAttention blocks, not {type(layer.self_attn).__name__}"
            )
        layers.append(layer)
    return layers
