"""The EAGLE-3 draft head, in the layout vLLM, SGLang and SpecForge load
(e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B): config.json with `LlamaForCausalLMEagle3` and
`draft_vocab_size`; tensors

    fc.weight                              [hidden, 3 * target_hidden]: fuses low/middle/high
    midlayer.input_layernorm.weight        the embedding's norm
    midlayer.hidden_norm.weight            the hidden state's norm
    midlayer.self_attn.{q,k,v}_proj.weight [.., 2 * hidden]: over concat(embedding, hidden)
    midlayer.self_attn.o_proj.weight, midlayer.post_attention_layernorm.weight,
    midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight            [draft_vocab_size, hidden]
    d2t                                    [draft_vocab_size] int64: target id - draft id
    t2d                                    [vocab_size] bool (which target ids the head has;
                                           implied by d2t, not read)
    embed_tokens.weight                    optional: without it the head uses the target's

One position p of the head takes the embedding of token p + 1 and a hidden state for position p
(the target's fused ones for verified tokens, its own pre-norm output while chaining drafts) and
predicts token p + 2.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from types import ModuleType

import torch
from torch import nn

from kiln.attention.backend import AttentionBackend, AttentionMetadata
from kiln.errors import ModelLoadError
from kiln.layers.linear import Linear, UnquantizedLinearMethod
from kiln.layers.rotary import build_cos_sin_cache
from kiln.models.base import CausalLM
from kiln.models.blocks import DecoderLayer
from kiln.models.config import ModelConfig
from kiln.models.llama import LAYER_TENSOR_MAP

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


def default_aux_layer_ids(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose input streams the head fuses (low, middle, high), as EAGLE-3's
    training code and vLLM / SGLang choose them when the checkpoint names none."""
    return (2, num_target_layers // 2, num_target_layers - 3)


class Eagle3Head(nn.Module):
    # Registered buffers, typed here (nn.Module's attribute lookup types them Tensor | Module).
    draft_to_target: torch.Tensor
    cos_sin_cache: torch.Tensor

    def __init__(
        self,
        cfg: ModelConfig,  # the head's: hidden size, heads, MLP width, rope; 1 layer
        draft_vocab_size: int,
        target_hidden_size: int,
        aux_layer_ids: tuple[int, ...],
        max_positions: int,
        dtype: torch.dtype | None,
        has_embedding: bool,
        norm_before_residual: bool = False,
    ) -> None:
        super().__init__()
        self.config = cfg  # num_hidden_layers = 1: what the memory plan sizes its KV by
        self.draft_vocab_size = draft_vocab_size
        self.aux_layer_ids = aux_layer_ids
        self.norm_before_residual = norm_before_residual
        hidden = cfg.hidden_size
        self.fc = Linear(len(aux_layer_ids) * target_hidden_size, hidden, dtype=dtype)
        self.midlayer = DecoderLayer(cfg, "midlayer", lambda name: UnquantizedLinearMethod(), dtype)
        attn = self.midlayer.self_attn
        # The attention reads concat(normed embedding, normed hidden): twice as wide.
        attn.qkv_proj = Linear(
            2 * hidden,
            attn.q_size + 2 * attn.kv_size,
            bias=cfg.attention_bias,
            output_sizes=[attn.q_size, attn.kv_size, attn.kv_size],
            dtype=dtype,
        )
        self.midlayer.hidden_norm = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.norm = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.lm_head = Linear(hidden, draft_vocab_size, dtype=dtype)
        self.embed_tokens = (
            nn.Embedding(cfg.vocab_size, hidden, dtype=dtype) if has_embedding else None
        )
        # Draft id -> target id (arange + d2t), filled at load.
        self.register_buffer("draft_to_target", torch.arange(draft_vocab_size), persistent=False)
        cache = build_cos_sin_cache(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(
        self,
        ops: ModuleType,
        backend: AttentionBackend,
        embedding: nn.Module,  # the head's own, or the target's
        input_ids: torch.Tensor,  # [num_tokens]: token p + 1 for position p
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]: fused target states or the head's own
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (final-normed, pre-norm) [num_tokens, hidden]
        layer, eps = self.midlayer, self.config.rms_norm_eps
        attn, mlp = layer.self_attn, layer.mlp
        embeds = ops.rms_norm(embedding(input_ids), layer.input_layernorm, eps)
        normed_hidden = ops.rms_norm(hidden, layer.hidden_norm, eps)
        residual = normed_hidden if self.norm_before_residual else hidden
        qkv = attn.qkv_proj(ops, torch.cat([embeds, normed_hidden], dim=-1))
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        hd = attn.head_dim
        query = ops.rotary_embedding_write_kv(
            positions,
            q.reshape(-1, attn.num_heads, hd),
            k.reshape(-1, attn.num_kv_heads, hd),
            v.reshape(-1, attn.num_kv_heads, hd),
            self.cos_sin_cache,
            kv_cache[0],
            kv_cache[1],
            metadata.slot_mapping,
        )
        out = backend.forward(query, kv_cache[0], kv_cache[1], metadata, attn.scale)
        attn_out = attn.o_proj(ops, out.reshape(-1, attn.q_size))
        mlp_out, residual = mlp(ops, attn_out, residual, layer.post_attention_layernorm, eps)
        return ops.fused_add_rms_norm(mlp_out, residual, self.norm, eps)

    def fuse(self, ops: ModuleType, aux: torch.Tensor) -> torch.Tensor:
        """[n, 3 * target_hidden] low/middle/high target states -> [n, hidden]."""
        return self.fc(ops, aux)

    def draft_token_ids(self, ops: ModuleType, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft, as target ids: argmax over the head's vocabulary, mapped."""
        return self.draft_to_target[ops.argmax(self.lm_head(ops, normed))]


# ---- loading ---------------------------------------------------------------------------------

_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def load_eagle3_head(
    path: str, target: CausalLM, device: torch.device, dtype: torch.dtype
) -> Eagle3Head:
    """Read an EAGLE-3 checkpoint directory and check it fits `target` (hidden size,
    vocabulary, layers); a ModelLoadError names what does not."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ModelLoadError(f"speculative_config.model: {config_path} does not exist")
    with open(config_path) as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ModelLoadError(
            f"speculative_config.model: {path} is not an EAGLE-3 head (architectures {archs}; "
            f"expected one of {list(ARCHITECTURES)})"
        )
    cfg = ModelConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"]})
    tcfg = target.full_config
    target_hidden = int(raw.get("target_hidden_size") or cfg.hidden_size)
    draft_vocab = int(raw.get("draft_vocab_size") or cfg.vocab_size)
    where = f"speculative_config.model {path}"
    if target_hidden != tcfg.hidden_size:
        raise ModelLoadError(
            f"{where}: the head reads target hidden states of size {target_hidden}, the target's "
            f"hidden size is {tcfg.hidden_size}: this head was trained for another model"
        )
    if cfg.vocab_size != tcfg.vocab_size or draft_vocab > tcfg.vocab_size:
        raise ModelLoadError(
            f"{where}: the head's vocabulary has {cfg.vocab_size} tokens (drafting over "
            f"{draft_vocab}), the target's {tcfg.vocab_size}: this head was trained for another "
            "model"
        )
    eagle = raw.get("eagle_config") or {}
    layer_ids = tuple(eagle.get("eagle_aux_hidden_state_layer_ids") or ()) or (
        default_aux_layer_ids(tcfg.num_hidden_layers)
    )
    tensors = dict(_read_tensors(path))
    has_embedding = "embed_tokens.weight" in tensors
    if not has_embedding and cfg.hidden_size != tcfg.hidden_size:
        raise ModelLoadError(
            f"{where}: the head's hidden size is {cfg.hidden_size} and it has no embedding of its "
            f"own; the target's embedding is {tcfg.hidden_size} wide"
        )
    head = Eagle3Head(
        cfg,
        draft_vocab,
        target_hidden,
        layer_ids,
        target.cos_sin_cache.shape[0],
        dtype,
        has_embedding,
        bool(raw.get("norm_before_residual", False)),
    )
    _load(head, tensors, where)
    return head.to(device)


def _read_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            from safetensors.torch import load_file

            yield from load_file(file).items()
        else:
            yield from torch.load(file, map_location="cpu", weights_only=True).items()
        return
    raise ModelLoadError(f"speculative_config.model: {path} has none of {list(_WEIGHT_FILES)}")


# midlayer checkpoint name -> (parameter name, fused shard): a Llama decoder layer's, and its
# hidden state's norm
_FUSED = {**LAYER_TENSOR_MAP, "hidden_norm.weight": ("hidden_norm", None)}
_TOP = {"norm.weight": "norm"}


@torch.no_grad()
def _load(head: Eagle3Head, tensors: dict[str, torch.Tensor], where: str) -> None:
    params = dict(head.named_parameters())
    linears = {
        f"{prefix}.{n}": m
        for prefix, m in head.named_modules()
        if isinstance(m, Linear)
        for n, _ in m.named_parameters(recurse=False)
    }
    loaded: set[str] = set()
    for name, tensor in tensors.items():
        if name == "t2d":
            continue  # the mask d2t implies
        if name == "d2t":
            if tensor.shape != (head.draft_vocab_size,):
                raise ModelLoadError(
                    f"{where}: d2t has shape {tuple(tensor.shape)}, expected "
                    f"({head.draft_vocab_size},)"
                )
            target_ids = torch.arange(head.draft_vocab_size) + tensor.long()
            if target_ids.min() < 0 or target_ids.max() >= head.config.vocab_size:
                raise ModelLoadError(f"{where}: d2t maps draft ids outside the target vocabulary")
            head.draft_to_target.copy_(target_ids)
            loaded.add("d2t")
            continue
        shard = None
        if name.startswith("midlayer."):
            rest = name.removeprefix("midlayer.")
            target, shard = _FUSED.get(rest, (rest, None))
            target = f"midlayer.{target}"
        else:
            target = _TOP.get(name, name)
        param = params.get(target)
        if param is None:
            raise ModelLoadError(f"{where}: unexpected tensor {name!r} in an EAGLE-3 head")
        owner = linears.get(target)
        view = owner.shard_view(param, shard) if owner is not None else param
        if tuple(view.shape) != tuple(tensor.shape):
            raise ModelLoadError(
                f"{where}: tensor {name!r} has shape {tuple(tensor.shape)}, the head expects "
                f"{tuple(view.shape)} (a head for another target?)"
            )
        view.copy_(tensor)
        loaded.add(f"{target}:{shard}")
    expected = []
    for pname, _ in head.named_parameters():
        owner = linears.get(pname)
        if owner is not None and len(owner.output_sizes) > 1:
            expected += [f"{pname}:{i}" for i in range(len(owner.output_sizes))]
        else:
            expected.append(f"{pname}:None")
    missing = [k for k in expected if k not in loaded]
    if "d2t" not in loaded and head.draft_vocab_size != head.config.vocab_size:
        missing.append("d2t")
    if missing:
        raise ModelLoadError(f"{where}: the head lacks {len(missing)} tensors, e.g. {missing[:3]}")
    for module in head.modules():
        if isinstance(module, Linear):
            module.method.process_weights_after_loading(module)
