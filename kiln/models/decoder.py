"""The decoder-only model every family shares: embedding, decoder layers (the family's blocks),
final norm and LM head (tied, float8 or cut by vocabulary rows), over packed tokens; pipeline
stages send and receive the stream between them; EAGLE-3 taps it. A family is a subclass that
names its checkpoint tensors (`layer_tensor_map`) and makes its layers (`make_layer`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping
from types import ModuleType
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from kiln.attention.backend import AttentionBackend, AttentionKind, AttentionMetadata
from kiln.distributed.comm import recv_from_prev_stage, send_to_next_stage
from kiln.distributed.parallel_state import ParallelContext, kv_head_range, split_layers
from kiln.errors import ModelLoadError
from kiln.layers.linear import Linear, LinearMethod, UnquantizedLinearMethod
from kiln.layers.moe_parallel import shard_moe_fields
from kiln.layers.rotary import LENGTH_DEPENDENT, StepRope, build_cos_sin_cache, rope_type_of
from kiln.layers.vocab_parallel import VocabParallelEmbedding
from kiln.models import weight_loader
from kiln.models.blocks import DecoderLayer, LinearMethodFactory, StepInputs
from kiln.models.config import ModelConfig

# One decoder layer's HF tensor (its name after "model.layers.N.") -> (kiln parameter, index of
# the fused shard in the layer's output_sizes, None when not fused).
LayerTensorMap = Mapping[str, tuple[str, int | None]]


def _unquantized(name: str) -> LinearMethod:
    return UnquantizedLinearMethod()


def shard_config(cfg: ModelConfig, ctx: ParallelContext | None) -> ModelConfig:
    """The part of the model one rank holds, as a ModelConfig: its query and KV heads, its MLP
    width, its experts' width or its experts (expert parallelism) and its pipeline stage's
    layers (what the KV cache, the memory plan and the runner are sized by). `cfg` itself at
    TP=1, PP=1."""
    if ctx is None or (ctx.tp_size == 1 and ctx.pp_size == 1):
        return cfg
    tp = ctx.tp_size
    # A model whose every MLP is a mixture of experts has no dense width to cut (Mixtral's
    # intermediate_size is its experts'; shard_moe_fields checks those).
    dense = any(not cfg.is_sparse_layer(i) for i in range(cfg.num_hidden_layers))
    for name in ("num_attention_heads", "intermediate_size")[: 2 if dense else 1]:
        if getattr(cfg, name) % tp:
            raise ModelLoadError(
                f"{name}={getattr(cfg, name)} does not split over tensor_parallel_size={tp}"
            )
    try:
        _, kv_heads = kv_head_range(cfg.num_key_value_heads, tp, ctx.tp_rank)
        layers = split_layers(cfg.num_hidden_layers, ctx.pp_size, ctx.pp_rank)
        experts = {}
        if cfg.num_experts and tp > 1:  # a slice of every expert, or whole ones (EP)
            experts = shard_moe_fields(
                cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                tp, ctx.tp_rank, ctx.expert_parallel,
            )  # fmt: skip
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    return dataclasses.replace(
        cfg,
        **experts,  # type: ignore[arg-type]
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=kv_heads,
        intermediate_size=cfg.intermediate_size // tp,
        num_hidden_layers=len(layers),
        layer_types=cfg.layer_types and cfg.layer_types[layers.start : layers.stop],
    )


class DecoderForCausalLM(nn.Module):
    """`linear_method` gives every decoder projection (qkv, o, gate_up, down) its LinearMethod
    by qualified name; None: unquantized. The LM head is unquantized unless `lm_head_method`
    gives it one (EngineConfig.lm_head_quantization="fp8": its bytes halve, at an accuracy
    cost); with tied embeddings the head is then a float8 copy of the embedding, which itself
    stays in the model dtype for the lookup. Under TP the float8 head is cut by vocabulary rows
    as the embedding is, and its logits gathered.

    `dtype` is where the parameters are made; with a quantized method pass it rather than calling
    `.to(dtype)` afterwards, which would widen the float8 weights and their fp32 scales.

    `parallel`: this rank's place under tensor/pipeline parallelism (None: the whole model).
    `config` is then this rank's shard (shard_config: its heads, MLP width, layers) and
    `full_config` the whole model's. Under PP every stage keeps the (vocab-cut) embedding, the
    final norm and the LM head, though only the first and last stage use them: simple, and small
    next to the layers."""

    layer_tensor_map: ClassVar[LayerTensorMap]
    # SmoothQuant folds into input_layernorm / post_attention_layernorm and the q/k/v, gate/up
    # checkpoint tensors (kiln.builder.calibrate.smoothing): families shaped otherwise say no.
    supports_smoothing: ClassVar[bool] = True
    # Registered parameters, buffers and submodules, typed here (nn.Module's attribute lookup
    # types them Tensor | Module). The embedding is cut by vocabulary rows under TP; the head is
    # None when it is the (model-dtype, tied) embedding.
    embed_tokens: nn.Embedding | VocabParallelEmbedding
    lm_head: Linear | VocabParallelEmbedding | None
    norm: torch.Tensor
    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,
        max_positions: int,
        linear_method: LinearMethodFactory | None = None,
        dtype: torch.dtype | None = None,
        parallel: ParallelContext | None = None,
        lm_head_method: LinearMethod | None = None,
    ) -> None:
        super().__init__()
        if parallel is not None and parallel.tp_size == 1 and parallel.pp_size == 1:
            parallel = None
        self.parallel = parallel
        self.full_config = cfg
        self.config = shard_config(cfg, parallel)
        method = linear_method or _unquantized
        tp = parallel if parallel is not None and parallel.tp_size > 1 else None
        self.layer_start = 0  # the global index of this stage's first layer
        if parallel is not None:
            self.layer_start = split_layers(
                cfg.num_hidden_layers, parallel.pp_size, parallel.pp_rank
            ).start
        # The runner computes logits (and samples) only where this is True: the last stage.
        self.computes_logits = parallel is None or parallel.layout.is_last_stage
        if tp is None:
            # Uninitialised: every loader overwrites it (nn.Embedding's own normal_ init took
            # ~1 s per 32k rows of an 8B-wide table on the CPU, for nothing).
            weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        else:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        layers = [
            self.make_layer(self.config, f"layers.{self.layer_start + i}", method, dtype, tp, cfg)
            for i in range(self.config.num_hidden_layers)
        ]
        for i, layer in enumerate(layers):
            # Each layer's kind is data its attention passes to the backend (a window here, full
            # attention there: Gemma 2/3 alternate).
            layer.self_attn.kind = AttentionKind(
                cfg.layer_window(self.layer_start + i), cfg.attn_logit_softcapping
            )
        self.layers = nn.ModuleList(layers)
        # A hybrid model's KV cache group of each layer (kiln.models.kv_groups): the forward
        # hands a layer its group's block tables. None: one group, one table for all.
        self.layer_groups: tuple[int, ...] | None = None
        layout = cfg.kv_cache_layout
        if layout.is_hybrid:
            placement = layout.placement()
            self.layer_groups = tuple(
                placement[self.layer_start + i][0] for i in range(len(layers))
            )
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self._make_head(cfg, dtype, tp, lm_head_method)
        rope = (cfg.rotary_dim, max_positions)
        cache = build_cos_sin_cache(
            *rope, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.step_rope: StepRope | None = None
        if rope_type_of(cfg.rope_scaling) in LENGTH_DEPENDENT:
            assert cfg.rope_scaling is not None
            self.step_rope = StepRope(
                *rope, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings, dtype
            )
        # Other tables by name (StepInputs.rope_tables), in the model dtype's values as the
        # loader rounds the main one.
        self.rope_tables: dict[str, torch.Tensor] = {}
        for name, theta in self.extra_rope_bases(cfg).items():
            if self.step_rope is not None:
                raise ModelLoadError("per-layer rotary bases with a length-dependent rope_scaling")
            table = build_cos_sin_cache(*rope, theta, None).to(dtype or torch.float32).float()
            self.register_buffer(f"rope_table_{name}", table, persistent=False)
            self.rope_tables[name] = table
        # The embedding's scale (Gemma's sqrt(hidden), rounded to the model dtype as
        # transformers rounds it; Granite's embedding_multiplier).
        self.embedding_multiplier = cfg.embedding_multiplier
        # EAGLE-3 (kiln.spec_decode.eagle3): layer index -> its column blocks in
        # `aux_hidden_states`; empty (and the forward writes nothing) unless a head is loaded.
        self._aux_columns: dict[int, list[int]] = {}
        self.aux_hidden_states: torch.Tensor | None = None

    def make_layer(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None,
        full: ModelConfig,
    ) -> DecoderLayer:
        """One decoder layer of the family (`cfg` this rank's shard, `full` the whole model's)."""
        return DecoderLayer(cfg, prefix, method, dtype, ctx, full)

    def extra_rope_bases(self, cfg: ModelConfig) -> dict[str, float]:
        """The rotary tables besides the model's, by name -> base (plain rotary): a layer made
        with `rope_table=name` rotates by it. Gemma 3's local layers: "local"."""
        if cfg.rope_local_base_freq is None:
            return {}
        return {"local": cfg.rope_local_base_freq}

    def adapt_hf_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint's HF-named tensors as the shared blocks compute with them: the block
        multipliers folded in (Granite's residual_multiplier into o_proj and down_proj, the
        logits' multiplier into the final norm). A family whose checkpoint differs more (fused
        tensors, a norm's offset) adapts them first, then calls this."""
        cfg = self.config
        residual, logits = cfg.residual_multiplier, cfg.logits_multiplier
        for name, tensor in weights:
            if residual != 1.0 and (".o_proj." in name or ".down_proj." in name):
                if name.endswith((".weight_scale", ".weight_scales", ".bias")) or (
                    name.endswith(".weight") and tensor.element_size() > 1
                ):
                    tensor = tensor * residual
            elif logits != 1.0 and name == "model.norm.weight":
                tensor = tensor * logits
            yield name, tensor

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        """The first layer's input: the embedding, times the family's multiplier."""
        hidden = self.embed_tokens(input_ids)
        if self.embedding_multiplier != 1.0:
            hidden = hidden * self.embedding_multiplier
        return hidden

    def step_inputs(
        self,
        ops: ModuleType,
        backend: AttentionBackend,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> StepInputs:
        """What every layer of one forward shares: the rotary table(s) and the positions that
        index them (a length-dependent rope's table is the step's own)."""
        table = self.cos_sin_cache
        if self.step_rope is not None:
            positions, table = self.step_rope(
                positions, metadata.query_start_loc, metadata.seq_lens, table
            )
        return StepInputs(ops, backend, positions, table, metadata, self.rope_tables)

    def _make_head(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype | None,
        tp: ParallelContext | None,
        lm_head_method: LinearMethod | None,
    ) -> None:
        """A head with its own method (float8) is its own Linear, filled from the embedding when
        the checkpoint ties them; a tied model-dtype head is the embedding itself (None)."""
        self.tied_head = cfg.tie_word_embeddings
        self.head_quantized = lm_head_method is not None
        if lm_head_method is not None:
            # Under TP column-parallel: each rank the embedding's rows (zero-padded alike).
            embedding = self.embed_tokens
            split, rows = None, cfg.vocab_size
            if isinstance(embedding, VocabParallelEmbedding):
                split, rows = embedding.row_split(), embedding.rows
            self.lm_head = Linear(
                cfg.hidden_size, rows, method=lm_head_method, dtype=dtype, split=split
            )
        elif cfg.tie_word_embeddings:
            self.lm_head = None
        elif tp is None:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)

    @property
    def device(self) -> torch.device:
        return self.norm.device

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def enable_aux_hidden_states(self, layer_ids: tuple[int, ...], max_num_tokens: int) -> None:
        """From now on every forward also writes the residual stream entering each of these
        layers (the hidden state after the layer before it) into `aux_hidden_states`
        [max_num_tokens, len(layer_ids) * hidden], one row per token of the forward, in order:
        what an EAGLE-3 head drafts from. A preallocated buffer, so a CUDA graph replays the
        writes into it. The sums are the fused add + norm's own output: three row copies a
        forward, nothing recomputed."""
        if any(not 0 <= i < len(self.layers) for i in layer_ids):
            raise ModelLoadError(
                f"EAGLE-3 auxiliary hidden-state layers {layer_ids} are not all among the "
                f"target's {len(self.layers)} layers"
            )
        hidden = self.full_config.hidden_size
        self._aux_columns = {}
        for c, i in enumerate(layer_ids):
            self._aux_columns.setdefault(i, []).append(c * hidden)
        self.aux_hidden_states = torch.zeros(
            max_num_tokens, len(layer_ids) * hidden, dtype=self.dtype, device=self.device
        )

    def _aux_tap(self, index: int, num_tokens: int) -> Callable[[torch.Tensor], None] | None:
        """EAGLE-3: copies the stream entering layer `index` into its columns, if it is tapped."""
        columns = self._aux_columns.get(index)
        if columns is None:
            return None
        aux = self.aux_hidden_states
        assert aux is not None, "enable_aux_hidden_states makes the buffer with the columns"

        def tap(residual: torch.Tensor) -> None:
            width = residual.shape[1]
            for column in columns:
                aux[:num_tokens, column : column + width].copy_(residual)

        return tap

    def forward(
        self,
        ops: ModuleType,
        backend: AttentionBackend,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], final-normed
        pp = self.parallel if self.parallel is not None and self.parallel.pp_size > 1 else None
        if pp is None or pp.layout.is_first_stage:
            hidden = self.embed(input_ids)
            residual = None  # the residual stream; `hidden` is the last block's output until added
        else:  # the previous stage's (block output, residual stream), as one [2, n, hidden]
            shape = (2, input_ids.shape[0], self.full_config.hidden_size)
            hidden, residual = recv_from_prev_stage(pp, shape, self.norm).unbind(0)
        step = self.step_inputs(ops, backend, positions, metadata)
        steps = [step]
        if metadata.group_metadata and self.layer_groups is not None:
            others = metadata.group_metadata
            steps += [dataclasses.replace(step, metadata=m) for m in others]
        num_tokens = input_ids.shape[0]
        # The last layer's output norm, applied by its reader (DecoderLayer.output_norm).
        hidden_norm: torch.Tensor | None = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            tap = self._aux_tap(index, num_tokens) if self._aux_columns else None
            group = self.layer_groups[index] if len(steps) > 1 and self.layer_groups else 0
            hidden, residual = layer(steps[group], hidden, residual, kv_cache, tap, hidden_norm)
            hidden_norm = getattr(layer, "output_norm", None)
        if pp is not None and not pp.layout.is_last_stage:
            # Both tensors, not their sum: the next stage's first fused add + norm then rounds
            # exactly as one process would.
            assert residual is not None, "a pipeline stage holds at least one layer"
            if hidden_norm is not None:  # the next stage does not hold this layer's norm
                hidden = ops.rms_norm(hidden, hidden_norm, self.config.rms_norm_eps)
            send_to_next_stage(pp, torch.stack((hidden, residual)))
            return hidden  # no logits here (computes_logits is False)
        assert residual is not None, "a model has at least one layer"
        return self.final_norm(ops, hidden, residual, hidden_norm)

    def final_norm(
        self,
        ops: ModuleType,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        hidden_norm: torch.Tensor | None = None,  # the last layer's output_norm
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The final norm of the last layer's output (RMS-normed by `hidden_norm` first, in the
        same kernel) added to the stream (a LayerNorm family's is a LayerNorm)."""
        eps = self.config.rms_norm_eps
        if hidden_norm is None:
            return ops.fused_add_rms_norm(hidden, residual, self.norm, eps)[0]
        return ops.fused_add_rms_norm(hidden, residual, self.norm, eps, hidden_norm)[0]

    def compute_logits(
        self, hidden: torch.Tensor, ops: ModuleType | None = None
    ) -> torch.Tensor:  # [n, vocab], model dtype
        """The logits of final-normed rows. `ops` (the forward's kernels) is needed by a
        quantized head only. Soft-capped where the family caps them (Gemma 2/3)."""
        logits = self._head_logits(hidden, ops)
        cap = self.config.final_logit_softcapping
        if cap is not None:  # as transformers: in the logits' dtype
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _head_logits(self, hidden: torch.Tensor, ops: ModuleType | None) -> torch.Tensor:
        # Not cast to fp32 here: a greedy batch takes its argmax on these as they are (the cast
        # is exact, so the argmax is the same) and skips writing and re-reading a fp32 copy.
        if self.head_quantized:
            if ops is None:
                raise ValueError("a quantized LM head needs the kernels: compute_logits(h, ops)")
            quantized = self.lm_head
            assert isinstance(quantized, Linear), "a quantized head is a Linear of its own"
            logits = quantized(ops, hidden)
            if quantized.split is not None:  # TP: cut by vocabulary rows, as the embedding is
                embedding = self.embed_tokens
                assert isinstance(embedding, VocabParallelEmbedding)
                logits = embedding.gather_logits(logits)
            return logits
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, VocabParallelEmbedding):  # TP: a collective of the tensor ranks
            return head.logits(hidden)
        return F.linear(hidden, head.weight)

    # ---- weights (kiln.models.weight_loader) ---------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, each through its layer's loader (which places q/k/v
        and gate/up into their fused projection), then let every linear method process them."""
        weight_loader.load_hf_weights(self, self.adapt_hf_weights(weights), self.layer_tensor_map)
        self.process_weights_after_loading()

    @torch.no_grad()
    def load_fused_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]], cut: bool = True, adopt: bool = False
    ) -> None:
        """Copy tensors named as `named_parameters()` names them (already fused: qkv_proj,
        gate_up_proj; what an engine directory holds) in, strictly: every parameter exactly
        once, with its shape and dtype. Linear parameters go through their method's loader, so
        a quantized method's parameters (fp8 weights, scales) load the same way. Under TP each
        tensor is cut to this rank's part unless `cut` is False (a `kiln build -tp N` shard,
        already cut). `adopt`: the tensors are the caller's to give away (an engine reader's
        fresh device buffers), so an uncut one may become its parameter's storage, not a copy."""
        weight_loader.load_engine_weights(self, weights, cut, adopt)
        self.process_weights_after_loading()

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights at the scale of a trained model (normal, std 0.02; norms at 1): not
        zeros or garbage, which run at different speeds than real data; processed as loaded
        ones are, so they run on the same kernels (INT4's codes re-laid for the sm_90 one)."""
        weight_loader.init_dummy_weights(self, seed)
        self.process_weights_after_loading()
