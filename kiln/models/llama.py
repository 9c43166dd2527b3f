"""The Llama family (Llama 2/3/3.x, Mistral, Qwen2/2.5, SmolLM2, TinyLlama) over packed tokens.

q/k/v and gate/up projections are fused into one matmul each at load time; tokens of all
sequences are packed into one [num_tokens, hidden] batch with no padding.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.distributed.comm import recv_from_prev_stage, send_to_next_stage
from kiln.distributed.parallel_state import ParallelContext, kv_head_range, split_layers
from kiln.errors import ModelLoadError
from kiln.layers.linear import Linear, LinearMethod, TensorSplit, UnquantizedLinearMethod
from kiln.layers.rotary import build_cos_sin_cache
from kiln.layers.vocab_parallel import VocabParallelEmbedding
from kiln.models.config import ModelConfig

# A layer's qualified name (e.g. "layers.3.self_attn.qkv_proj") -> its LinearMethod.
LinearMethodFactory = Callable[[str], LinearMethod]


def _unquantized(name: str) -> LinearMethod:
    return UnquantizedLinearMethod()


def shard_config(cfg: ModelConfig, ctx: ParallelContext | None) -> ModelConfig:
    """The part of the model one rank holds, as a ModelConfig: its query and KV heads, its MLP
    width and its pipeline stage's layers (what the KV cache, the memory plan and the runner are
    sized by). `cfg` itself at TP=1, PP=1."""
    if ctx is None or (ctx.tp_size == 1 and ctx.pp_size == 1):
        return cfg
    tp = ctx.tp_size
    for name in ("num_attention_heads", "intermediate_size"):
        if getattr(cfg, name) % tp:
            raise ModelLoadError(
                f"{name}={getattr(cfg, name)} does not split over tensor_parallel_size={tp}"
            )
    try:
        _, kv_heads = kv_head_range(cfg.num_key_value_heads, tp, ctx.tp_rank)
        layers = split_layers(cfg.num_hidden_layers, ctx.pp_size, ctx.pp_rank)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    return dataclasses.replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // tp,
        num_key_value_heads=kv_heads,
        intermediate_size=cfg.intermediate_size // tp,
        num_hidden_layers=len(layers),
    )


class LlamaAttention(nn.Module):
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
        # cfg is this rank's shard (shard_config); `full` the whole model's, under TP.
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        qkv_split = o_split = None
        if ctx is not None and ctx.tp_size > 1:
            # Query heads split evenly; KV heads split, or replicated when fewer than ranks.
            hd, r = self.head_dim, ctx.tp_rank
            kv_start, _ = kv_head_range(full.num_key_value_heads, ctx.tp_size, r)
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
            self.q_size,
            cfg.hidden_size,
            method=method(f"{prefix}.o_proj"),
            dtype=dtype,
            split=o_split,
        )

    # No forward: the decoder loop calls qkv_proj's fused entry point (residual add + norm + qkv
    # + rotary + the KV-cache write, one kernel at batch-1 decode on the GPU), the attention
    # backend, and o_proj.


class LlamaMLP(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        prefix: str,
        method: LinearMethodFactory,
        dtype: torch.dtype | None,
        ctx: ParallelContext | None = None,
    ) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        n = cfg.intermediate_size  # this rank's share under TP
        gate_up_split = down_split = None
        if ctx is not None and ctx.tp_size > 1:
            rows = (ctx.tp_rank * n, n)
            gate_up_split = TensorSplit(ctx, rows=(rows, rows), full_sizes=(n * ctx.tp_size,) * 2)
            down_split = TensorSplit(ctx, cols=rows)
        self.gate_up_proj = Linear(
            cfg.hidden_size,
            2 * n,
            output_sizes=[n, n],
            method=method(f"{prefix}.gate_up_proj"),
            dtype=dtype,
            split=gate_up_split,
        )
        self.down_proj = Linear(
            n, cfg.hidden_size, method=method(f"{prefix}.down_proj"), dtype=dtype, split=down_split
        )

    # No forward: the decoder loop calls gate_up_proj's fused entry point (residual add + norm +
    # gate_up + activation, one kernel at batch-1 decode on the GPU, then down_proj).


class LlamaDecoderLayer(nn.Module):
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
        self.eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg, f"{prefix}.self_attn", method, dtype, ctx, full)
        self.mlp = LlamaMLP(cfg, f"{prefix}.mlp", method, dtype, ctx)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))


class LlamaForCausalLM(nn.Module):
    """`linear_method` gives every decoder projection (qkv, o, gate_up, down) its LinearMethod
    by qualified name; None: unquantized. The LM head is unquantized unless `lm_head_method`
    gives it one (EngineConfig.lm_head_quantization="fp8": its bytes halve, at an accuracy cost
    measured in docs/performance.md); with tied embeddings the head is then a float8 copy of the
    embedding, which itself stays in the model dtype for the lookup. Under TP the float8 head is
    cut by vocabulary rows as the embedding is, and its logits gathered.

    `dtype` is where the parameters are made; with a quantized method pass it rather than calling
    `.to(dtype)` afterwards, which would widen the float8 weights and their fp32 scales.

    `parallel`: this rank's place under tensor/pipeline parallelism (None: the whole model).
    `config` is then this rank's shard (shard_config: its heads, MLP width, layers) and
    `full_config` the whole model's. Under PP every stage keeps the (vocab-cut) embedding, the
    final norm and the LM head, though only the first and last stage use them: simple, and small
    next to the layers."""

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
        local = self.config
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
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(local, f"layers.{self.layer_start + i}", method, dtype, tp, cfg)
            for i in range(local.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size, dtype=dtype))
        # A head with its own method (float8): its own Linear, filled from the embedding when
        # the checkpoint ties them.
        self.tied_head = cfg.tie_word_embeddings
        self.head_quantized = lm_head_method is not None
        if lm_head_method is not None:
            # Under TP column-parallel: each rank the embedding's rows (zero-padded alike).
            split = None if tp is None else self.embed_tokens.row_split()
            rows = cfg.vocab_size if split is None else split.rows[0][1]
            self.lm_head = Linear(
                cfg.hidden_size, rows, method=lm_head_method, dtype=dtype, split=split
            )
        elif cfg.tie_word_embeddings:
            self.lm_head = None
        elif tp is None:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        else:
            self.lm_head = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        cache = build_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        # EAGLE-3 (kiln.spec_decode.eagle3): layer index -> its column blocks in
        # `aux_hidden_states`; empty (and the forward writes nothing) unless a head is loaded.
        self._aux_columns: dict[int, list[int]] = {}
        self.aux_hidden_states: torch.Tensor | None = None

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
            max_num_tokens, len(layer_ids) * hidden, dtype=self.norm.dtype, device=self.norm.device
        )

    def forward(
        self,
        ops: ModuleType,
        backend: AttentionBackend,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden], final-normed
        eps = self.config.rms_norm_eps
        pp = self.parallel if self.parallel is not None and self.parallel.pp_size > 1 else None
        if pp is None or pp.layout.is_first_stage:
            hidden = self.embed_tokens(input_ids)
            residual = None  # the residual stream; `hidden` is the last block's output until added
        else:  # the previous stage's (block output, residual stream), as one [2, n, hidden]
            shape = (2, input_ids.shape[0], self.full_config.hidden_size)
            hidden, residual = recv_from_prev_stage(pp, shape, self.norm).unbind(0)
        aux_columns, num_tokens = self._aux_columns, input_ids.shape[0]
        for index, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            attn, mlp = layer.self_attn, layer.mlp
            # Each projection takes the ops around it (residual add + RMSNorm before; rotary and
            # the KV-cache write, or SiLU-mul, after): one kernel each at batch-1 decode on the
            # GPU, where a step is otherwise mostly small launch-bound kernels.
            query, residual = attn.qkv_proj.add_rms_norm_qkv_rotary_write_kv(
                ops, hidden, residual, layer.input_layernorm, eps,
                positions, self.cos_sin_cache, k_cache, v_cache, metadata.slot_mapping,
            )  # fmt: skip
            if aux_columns and index in aux_columns:  # EAGLE-3: the stream entering this layer
                width = residual.shape[1]
                for column in aux_columns[index]:
                    self.aux_hidden_states[:num_tokens, column : column + width].copy_(residual)
            out = backend.forward(query, k_cache, v_cache, metadata, attn.scale)
            hidden = attn.o_proj(ops, out.reshape(-1, attn.q_size))
            # gate_up is [gate; up]: down_proj(silu(gate) * up) (float8 between them with FP8).
            hidden, residual = mlp.gate_up_proj.silu_mul_into(
                ops, mlp.down_proj, hidden, residual, layer.post_attention_layernorm, eps
            )
        if pp is not None and not pp.layout.is_last_stage:
            # Both tensors, not their sum: the next stage's first fused add + norm then rounds
            # exactly as one process would.
            send_to_next_stage(pp, torch.stack((hidden, residual)))
            return hidden  # no logits here (computes_logits is False)
        hidden, _ = ops.fused_add_rms_norm(hidden, residual, self.norm, eps)
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, ops: ModuleType | None = None
    ) -> torch.Tensor:  # [n, vocab], model dtype
        """The logits of final-normed rows. `ops` (the forward's kernels) is needed by a
        quantized head only."""
        # Not cast to fp32 here: a greedy batch takes its argmax on these as they are (the cast
        # is exact, so the argmax is the same) and skips writing and re-reading a fp32 copy.
        if self.head_quantized:
            if ops is None:
                raise ValueError("a quantized LM head needs the kernels: compute_logits(h, ops)")
            logits = self.lm_head(ops, hidden)
            if self.lm_head.split is not None:
                logits = self.embed_tokens.gather_logits(logits)
            return logits
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if isinstance(head, VocabParallelEmbedding):  # TP: a collective of the tensor ranks
            return head.logits(hidden)
        return F.linear(hidden, head.weight)

    # ---- weights -------------------------------------------------------------------------

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, each through its layer's loader (which places q/k/v
        and gate/up into their fused projection), then let every linear method process them."""
        params = dict(self.named_parameters())
        owners = self._linear_owners()
        loaded: set[str] = set()
        fp8_loaded: set[str] = set()
        for hf_name, tensor in weights:
            target = _map_hf_name(hf_name)
            if target is None:
                continue
            name, shard = target
            if name == "lm_head.weight" and self.tied_head:
                continue  # tied: the embedding serves as the output projection (or fills it)
            name = self._local_name(name)
            if name is None:
                continue  # another pipeline stage's layer
            if name not in params:
                raise ModelLoadError(f"checkpoint tensor {hf_name!r} has no place in the model")
            param, owner = params[name], owners.get(name)
            if owner is not None and name.endswith("weight_scale"):
                tensor = _scale_rows(owner, param, shard, tensor)
            if tensor.dtype == torch.float8_e4m3fn and param.dtype != torch.float8_e4m3fn:
                raise ModelLoadError(
                    f"checkpoint tensor {hf_name!r} is float8 but the model was built without "
                    "FP8 weights (the checkpoint declares no FP8 scheme kiln reads)"
                )
            if owner is not None and not _cut_fits(owner, param, shard, tensor):
                raise ModelLoadError(
                    f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, the model expects "
                    f"{_checkpoint_part(owner, param, shard)} (of this tensor rank's part)"
                )
            if owner is None:
                self._copy_unsplit(name, param, tensor, hf_name)
            else:
                owner.weight_loader(param, shard, tensor)
            loaded.add(f"{name}:{shard}")
            if name == "embed_tokens.weight" and self.tied_head and self.head_quantized:
                self.lm_head.weight_loader(self.lm_head.weight, None, tensor)
                loaded.add("lm_head.weight:None")
            if tensor.dtype == torch.float8_e4m3fn:
                fp8_loaded.add(f"{name}:{shard}")
        missing = [k for k in self._expected_keys(owners) if k not in loaded]
        # float8 weights loaded as they are need their scales from the checkpoint too.
        missing += [
            k.replace(".weight:", ".weight_scale:")
            for k in sorted(fp8_loaded)
            if k.replace(".weight:", ".weight_scale:") not in loaded
        ]
        if missing:
            raise ModelLoadError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
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
        params = dict(self.named_parameters())
        owners = self._linear_owners()
        loaded: set[str] = set()
        for name, tensor in weights:
            engine_name, name = name, self._local_name(name)
            if name is None:
                continue  # another pipeline stage's layer
            param = params.get(name)
            if param is None:
                raise ModelLoadError(f"engine tensor {engine_name!r} has no place in the model")
            if name in loaded:
                raise ModelLoadError(f"engine tensor {engine_name!r} appears twice")
            owner, read = owners.get(name), tensor
            if not cut:
                pass
            elif owner is not None:  # TP: this rank's part of the fused tensor
                tensor = owner.cut(param, None, tensor)
            elif isinstance(self._vocab_owner(name), VocabParallelEmbedding):
                tensor = self._vocab_owner(name).cut(tensor)
            # An engine built with the head in the model dtype, loaded with a float8 head: the
            # head is quantized here (its scales too), as from a checkpoint.
            quantize_head = (
                owner is not None and owner is self.lm_head and self.head_quantized
                and param is owner.weight and tensor.dtype != param.dtype
            )  # fmt: skip
            if tuple(param.shape) != tuple(tensor.shape) or (
                param.dtype != tensor.dtype and not quantize_head
            ):
                raise ModelLoadError(
                    f"engine tensor {engine_name!r} is {tensor.dtype} {tuple(tensor.shape)}, the "
                    f"model expects {param.dtype} {tuple(param.shape)} (built with another dtype "
                    "or another tensor_parallel_size?)"
                )
            if adopt and tensor is read and _can_adopt(param, tensor):  # not a cut (a view of more)
                # The engine stores each tensor as its parameter holds it (same dtype and shape,
                # checked above), so the method's loader would copy it unchanged: take the
                # reader's (verified) device tensor as the parameter's storage instead of copying
                # it, which saves a device copy and, on the CPU, a page-faulting copy per weight.
                param.data = tensor
            elif owner is None:
                param.copy_(tensor)
            else:
                owner.method.load_weight(param, None, tensor)
            loaded.add(name)
            if quantize_head:
                loaded.add("lm_head.weight_scale")
        if self.head_quantized and self.tied_head and "lm_head.weight" not in loaded:
            self._fill_tied_head()  # an engine of a tied model built without a float8 head
            loaded.update(("lm_head.weight", "lm_head.weight_scale"))
        missing = [name for name in params if name not in loaded]
        if missing:
            raise ModelLoadError(f"engine lacks {len(missing)} tensors, e.g. {missing[:3]}")
        self.process_weights_after_loading()

    def _local_name(self, name: str) -> str | None:
        """A whole-model parameter name -> this stage's (layer indices from 0), or None for a
        layer another pipeline stage holds."""
        match = _LOCAL_RE.match(name)
        if match is None or self.parallel is None:
            return name
        index = int(match.group(1)) - self.layer_start
        if not 0 <= index < len(self.layers):
            return None
        return f"layers.{index}.{match.group(2)}"

    def _vocab_owner(self, name: str) -> nn.Module | None:
        return {"embed_tokens.weight": self.embed_tokens, "lm_head.weight": self.lm_head}.get(name)

    def _copy_unsplit(
        self, name: str, param: torch.Tensor, tensor: torch.Tensor, hf_name: str
    ) -> None:
        """A parameter no Linear owns: the norms, the embedding, a vocab-cut head."""
        owner = self._vocab_owner(name)
        if isinstance(owner, VocabParallelEmbedding):
            tensor = owner.cut(tensor)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(param.shape)}"
            )
        param.copy_(tensor)

    def _linear_owners(self) -> dict[str, Linear]:
        """Each Linear-owned parameter's name -> its layer (whose method loads it)."""
        return {
            f"{prefix}.{name}": module
            for prefix, module in self.named_modules()
            if isinstance(module, Linear)
            for name, _ in module.named_parameters(recurse=False)
        }

    def process_weights_after_loading(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.method.process_weights_after_loading(module)

    def _expected_keys(self, owners: dict[str, Linear]) -> list[str]:
        keys = []
        for name, _ in self.named_parameters():
            owner = owners.get(name)
            if _derived(name, owner):
                continue
            if owner is None or len(owner.output_sizes) == 1:
                keys.append(f"{name}:None")
            else:
                keys += [f"{name}:{shard}" for shard in range(len(owner.output_sizes))]
        return keys

    @torch.no_grad()
    def init_dummy_weights(self, seed: int) -> None:
        """Random weights at the scale of a trained model (normal, std 0.02; norms at 1): not
        zeros or garbage, which run at different speeds than real data."""
        gen = torch.Generator(device=self.norm.device).manual_seed(seed)
        owners = self._linear_owners()
        for name, param in self.named_parameters():
            owner = owners.get(name)
            if _derived(name, owner):
                continue
            if param.dim() == 1 and "bias" not in name:
                param.fill_(1.0)
            elif param.element_size() == 1:  # float8: drawn as a checkpoint would be, then loaded
                drawn = torch.empty(param.shape, device=param.device).normal_(
                    0.0, 0.02, generator=gen
                )
                owner.method.load_weight(param, None, drawn)  # drawn at this rank's shape
            else:
                param.normal_(0.0, 0.02, generator=gen)
        if self.head_quantized and self.tied_head:
            self._fill_tied_head()

    def _fill_tied_head(self) -> None:
        """A float8 head of a tied model: the embedding, quantized by the head's method."""
        head = self.lm_head
        head.method.load_weight(head.weight, None, self.embed_tokens.weight.detach())


def _can_adopt(param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether `tensor` can become `param`'s storage as it is: same device, dtype and shape, dense,
    and 16-byte aligned (what the kernels' vectorised loads and Triton's pointer specialisation
    expect of a freshly allocated parameter)."""
    return (
        tensor.device == param.device
        and tensor.dtype == param.dtype
        and tensor.shape == param.shape
        and tensor.is_contiguous()
        and tensor.data_ptr() % 16 == 0
    )


def _scale_rows(
    owner: Linear, param: torch.Tensor, shard: int | None, tensor: torch.Tensor
) -> torch.Tensor:
    """A pre-quantized checkpoint's weight scale as one scale per row of the full checkpoint
    tensor (what the weight's rows are cut from under TP): per channel it is [rows, 1], per
    tensor a single value, repeated for every row of the projection it scales."""
    if tensor.numel() != 1:
        return tensor.reshape(-1)
    split = owner.split
    if split is None or split.rows is None:  # TP=1, or row-parallel: every row is this rank's
        rows = owner.shard_view(param, shard).shape[0]
    elif shard is not None:
        rows = split.full_sizes[shard]
    else:
        rows = sum(split.full_sizes)
    return tensor.reshape(()).expand(rows)


def _checkpoint_part(owner: Linear, param: torch.Tensor, shard: int | None) -> tuple[int, ...]:
    """The shape of this rank's part of a checkpoint tensor for `param`'s shard `shard`."""
    return owner.method.checkpoint_shape(owner, param, tuple(owner.shard_view(param, shard).shape))


def _cut_fits(owner: Linear, param: torch.Tensor, shard: int | None, tensor: torch.Tensor) -> bool:
    """Whether a full checkpoint tensor, cut to this rank's part, fills its place in `param`."""
    want = _checkpoint_part(owner, param, shard)
    if owner.split is None:
        return tuple(tensor.shape) == want
    try:
        return tuple(owner.cut(param, shard, tensor).shape) == want
    except (RuntimeError, IndexError):  # narrow() past the end: the tensor is too small
        return False


def _derived(name: str, owner: Linear | None) -> bool:
    """A linear method's tensor that no HF checkpoint holds (a quantized weight's scale): its
    method's loader fills it while loading the weight."""
    return owner is not None and name.rsplit(".", 1)[-1] not in ("weight", "bias")


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_LOCAL_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# One decoder layer's HF tensors -> (kiln parameter, index of the fused shard in the layer's
# output_sizes, None when not fused). The EAGLE-3 head's midlayer loads by it too.
LAYER_TENSOR_MAP = {
    "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", 0),
    "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", 1),
    "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", 2),
    "self_attn.q_proj.bias": ("self_attn.qkv_proj.bias", 0),
    "self_attn.k_proj.bias": ("self_attn.qkv_proj.bias", 1),
    "self_attn.v_proj.bias": ("self_attn.qkv_proj.bias", 2),
    "self_attn.o_proj.weight": ("self_attn.o_proj.weight", None),
    "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", 0),
    "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", 1),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", None),
    "input_layernorm.weight": ("input_layernorm", None),
    "post_attention_layernorm.weight": ("post_attention_layernorm", None),
}

# A pre-quantized checkpoint's weight scales load into their projection's shard, as its weights.
_LAYER_MAP = {
    **LAYER_TENSOR_MAP,
    **{
        hf.removesuffix("weight") + "weight_scale": (
            ours.removesuffix("weight") + "weight_scale",
            i,
        )
        for hf, (ours, i) in LAYER_TENSOR_MAP.items()
        if hf.endswith("proj.weight")
    },
}
# Read before the model is built (input scales: kiln.checkpoint.prequantized) or not applied
# (the KV cache's scales: kiln's float8 cache is unscaled; the loader says so).
_SCALES_READ_ELSEWHERE = (".input_scale", ".k_scale", ".v_scale")


def _map_hf_name(hf_name: str) -> tuple[str, int | None] | None:
    """HF tensor name -> (kiln parameter name, fused shard) or None for tensors kiln ignores."""
    if hf_name.endswith("rotary_emb.inv_freq") or hf_name.endswith(_SCALES_READ_ELSEWHERE):
        return None
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", None
    if hf_name == "model.norm.weight":
        return "norm", None
    if hf_name == "lm_head.weight":
        return "lm_head.weight", None
    match = _LAYER_RE.match(hf_name)
    if match and match.group(2) in _LAYER_MAP:
        name, shard = _LAYER_MAP[match.group(2)]
        return f"layers.{match.group(1)}.{name}", shard
    raise ModelLoadError(f"unexpected tensor {hf_name!r} in a Llama-family checkpoint")
