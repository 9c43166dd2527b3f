"""ModelConfig: a decoder checkpoint's shape, read from (and written back to) HF config.json.

Every checkpoint reader (kiln/checkpoint: safetensors, GGUF) and the dummy-weight presets produce
one of these, so the model code never sees a raw config dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.errors import ModelLoadError
from kiln.models import family_config, mla_config, moe_config, registry
from kiln.models.kv_groups import KVCacheLayout, kv_cache_layout

# The deepest published decoders have ~130 layers; building 10k layers' modules already takes
# minutes on a CPU, and a config saying 1e7 would otherwise look like a hang.
MAX_LAYERS = 10_000
# Longer than any model's context (Llama 4 Scout's 10M included): a larger one is a typo that
# would size the rotary tables and the default max_model_len to match.
MAX_POSITIONS = 1 << 24
_POSITIVE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
)
_DTYPES = ("float32", "float16", "bfloat16")
# Spellings of the three dtypes seen in the wild config.json files.
_DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "half": "float16", "fp16": "float16"}


@dataclass(frozen=True)
class ModelConfig:
    """A decoder of one of the registered families (kiln.models.registry): RMSNorm, rotary
    attention with GQA, a gated MLP."""

    architecture: str
    """The family's name, as its HF model_type: "llama", "mistral", "qwen2", "qwen3"."""
    vocab_size: int
    """Rows of the embedding (and of lm_head)."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    num_hidden_layers: int
    """Number of decoder layers."""
    num_attention_heads: int
    """Query heads."""
    num_key_value_heads: int
    """Key/value heads (GQA); divides num_attention_heads."""
    head_dim: int
    """Per-head width; hidden_size // num_attention_heads unless the checkpoint says otherwise."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 10000.0
    """Rotary base frequency."""
    # hash=False: a dict is unhashable; configs differing only here still differ under ==.
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    """HF rope_scaling dict with a "rope_type" key (e.g. "llama3", "linear", "yarn"); None = plain
    rotary. Never contains rope_theta."""
    max_position_embeddings: int = 2048
    """Longest context the model was trained for."""
    tie_word_embeddings: bool = False
    """lm_head reuses the embedding matrix (the checkpoint may then have no lm_head.weight)."""
    attention_bias: bool = False
    """q/k/v projections have biases (always for qwen2; for llama HF also gives o_proj a bias)."""
    bos_token_id: int | None = None
    """Beginning-of-sequence token, if the model has one."""
    eos_token_ids: tuple[int, ...] = ()
    """Every token that ends generation (config.json and generation_config.json together)."""
    torch_dtype: str = "float32"
    """The dtype the checkpoint was trained/saved in: "float32", "float16" or "bfloat16"."""
    sliding_window: int | None = None
    """Attention window (each query sees the last `sliding_window` positions up to its own) of
    the layers `layer_types` names, or of every layer; None = full attention everywhere."""
    layer_types: tuple[str, ...] | None = None
    """Each layer's attention in Hugging Face's names, "sliding_attention" (the window) or
    "full_attention" (Qwen2's max_window_layers, Gemma 2/3's alternation); None: every layer
    alike."""
    attn_logit_softcapping: float | None = None
    """Attention scores become c * tanh(scores / c) before the softmax (Gemma 2); None: not."""

    # The block options of the families beyond Llama (kiln.models.family_config parses them).
    hidden_act: str = "silu"
    """The gated MLP's activation: "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU, Gemma)."""
    mlp_bias: bool = False
    """gate/up/down projections have biases (Llama's mlp_bias, Granite)."""
    partial_rotary_factor: float = 1.0
    """The fraction of each head's dims that rotary turns (StableLM, Phi-4-mini); the rest pass."""
    embedding_multiplier: float = 1.0
    """The embedding's output is multiplied by this (Gemma: sqrt(hidden); Granite)."""
    residual_multiplier: float = 1.0
    """Each block's output is multiplied by this before its residual add (Granite)."""
    attention_multiplier: float | None = None
    """The attention's query scale; None: head_dim ** -0.5 (Granite; Gemma 2/3's
    query_pre_attn_scalar ** -0.5)."""
    logits_multiplier: float = 1.0
    """Logits are multiplied by this (Granite: 1 / logits_scaling; Cohere: logit_scale)."""
    final_logit_softcapping: float | None = None
    """Logits are soft-capped to +-this, tanh(l / cap) * cap (Gemma 2/3); None: not."""
    rope_local_base_freq: float | None = None
    """The rotary base of the local (sliding) layers (Gemma 3); None: rope_theta everywhere."""
    qk_layernorm: bool = False
    """Queries and keys are normed per head before rotary (StableLM 2 12B, Cohere use_qk_norm)."""
    parallel_residual: bool = False
    """Attention and MLP both read the same normed input and add to the stream together
    (Cohere, StableLM use_parallel_residual)."""

    # Mixture-of-experts MLPs (kiln.models.moe_config parses them); num_experts 0: dense.
    num_experts: int = 0
    """Routed experts of each sparse layer's MLP (Mixtral num_local_experts, Qwen num_experts)."""
    num_experts_per_tok: int = 0
    """Experts each token is routed to (top-k)."""
    moe_intermediate_size: int = 0
    """Width of each expert's gated MLP (a dense layer's is intermediate_size)."""
    norm_topk_prob: bool = True
    """The top-k routing weights are renormalised to sum to 1 (Mixtral always; Qwen by flag)."""
    decoder_sparse_step: int = 1
    """Every n-th layer (1-based) is sparse, unless listed in mlp_only_layers (Qwen-MoE)."""
    mlp_only_layers: tuple[int, ...] = ()
    """Layers whose MLP is dense though the step would make them sparse (Qwen-MoE)."""
    shared_expert_intermediate_size: int = 0
    """Width of the shared expert every token also runs, gated by a sigmoid (Qwen2-MoE); 0: none."""
    expert_range: tuple[int, int] | None = None
    """(first, count) of the routed experts one rank holds whole under expert parallelism (a
    rank's shard_config sets it); None: every expert (one rank, or a slice of each under TP)."""
    moe_bias: bool = False
    """The router and each expert's projections have biases (gpt-oss)."""
    swiglu_limit: float | None = None
    """The experts' clamped SwiGLU (gpt-oss): gate clamped above at this, up to +-this, then
    (up + 1) * gate * sigmoid(swiglu_alpha * gate); None: SiLU(gate) * up."""
    swiglu_alpha: float = 1.702
    """The sigmoid's slope of the clamped SwiGLU (with swiglu_limit)."""
    moe_routing: str = "softmax"
    """How the router picks: "softmax" (top-k of the softmax) or "sigmoid" (DeepSeek-V3's and
    GLM-4.5's: sigmoid scores, an e_score_correction_bias on the choice, grouped top-k)."""
    n_group: int = 1
    """Groups the experts fall into for sigmoid routing (DeepSeek-V3 n_group)."""
    topk_group: int = 1
    """Groups whose experts a token may choose among (DeepSeek-V3 topk_group)."""
    routed_scaling_factor: float = 1.0
    """The sigmoid routing's weights are multiplied by this."""
    first_k_dense_replace: int = 0
    """The first layers whose MLP is dense (DeepSeek-V3, GLM-4.5)."""
    shared_expert_gated: bool = True
    """The shared expert's output is scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE);
    False: added as it is (GLM-4.5's shared_experts)."""
    per_channel_experts: bool = False
    """Float8 experts carry a scale per output channel, not one per expert: gpt-oss's (its MXFP4
    experts convert to them exactly) and a pre-quantized FP8 checkpoint's (llm-compressor's
    FP8_DYNAMIC per channel, ModelOpt's per tensor)."""

    # Multi-head latent attention (DeepSeek-V2/V3; kiln.models.mla_config parses them): the
    # cache then holds one head_dim = kv_lora_rank + qk_rope_head_dim wide "KV head" per token.
    kv_lora_rank: int = 0
    """Width of the compressed keys and values, the latent each token caches; 0: not MLA."""
    q_lora_rank: int | None = None
    """Width of the query's low-rank projection (q_a_proj); None: one q_proj."""
    qk_nope_head_dim: int = 0
    """Each query and key head's dims without rotary (the keys' from the latent)."""
    qk_rope_head_dim: int = 0
    """Each query head's rotary dims, and the one rotary key every head shares."""
    v_head_dim: int = 0
    """Each head's value width."""
    rope_interleave: bool = False
    """The checkpoint rotates dims (2i, 2i+1) as pairs (DeepSeek's); kiln's rotate-half kernels
    get them de-interleaved by a row permutation at load."""

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer `layer` (its index in the whole model); None: full."""
        if self.layer_types is None or self.layer_types[layer] == _SLIDING:
            return self.sliding_window
        return None

    def is_sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer` (its index in the whole model) has a mixture-of-experts MLP."""
        return (
            self.num_experts > 0
            and layer >= self.first_k_dense_replace
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def num_held_experts(self) -> int:
        """Routed experts whose weights one rank holds (all but under expert parallelism)."""
        return self.num_experts if self.expert_range is None else self.expert_range[1]

    def mlp_parameter_count(self, layer: int) -> int:
        """Weights of layer `layer`'s MLP: every held expert's (and the router's, the shared
        expert's) in a sparse layer, the gated MLP's in a dense one."""
        h = self.hidden_size
        if not self.is_sparse_layer(layer):
            return 3 * h * self.intermediate_size
        count = self.num_held_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h
        if self.moe_bias:  # the experts' gate_up and down biases, the router's
            count += self.num_held_experts * (2 * self.moe_intermediate_size + h) + self.num_experts
        if self.shared_expert_intermediate_size:
            count += 3 * h * self.shared_expert_intermediate_size
            count += h if self.shared_expert_gated else 0
        if self.moe_routing == "sigmoid":  # the choice's e_score_correction_bias
            count += self.num_experts
        return count

    @property
    def kv_window(self) -> int | None:
        """The window every layer has, else None: how much history each layer ever reads, so how
        far back the KV manager keeps a request's blocks."""
        return self.sliding_window if self.layer_types is None else None

    @property
    def kv_cache_layout(self) -> KVCacheLayout:
        """The KV cache groups of the whole model (kiln.models.kv_groups): one for a model whose
        layers attend alike; a full group and windowed ones for a hybrid (Gemma 2/3)."""
        return kv_cache_layout([self.layer_window(i) for i in range(self.num_hidden_layers)])

    def __post_init__(self) -> None:
        if not registry.is_supported(self.architecture):
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; "
                f"supported: {registry.supported_names()}"
            )
        for name in _POSITIVE_FIELDS:
            _require_positive(name, getattr(self, name))
        if self.num_hidden_layers > MAX_LAYERS:
            raise ModelLoadError(
                f"num_hidden_layers={self.num_hidden_layers} is more than any model has "
                f"(kiln builds at most {MAX_LAYERS})"
            )
        if self.max_position_embeddings > MAX_POSITIONS:
            raise ModelLoadError(
                f"max_position_embeddings={self.max_position_embeddings} is longer than any "
                f"model's context (at most {MAX_POSITIONS})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.torch_dtype not in _DTYPES:
            raise ModelLoadError(f"torch_dtype={self.torch_dtype!r} is not one of {_DTYPES}")
        if self.layer_types is not None and (
            len(self.layer_types) != self.num_hidden_layers
            or not set(self.layer_types) <= {_SLIDING, _FULL}
            or self.sliding_window is None
        ):
            raise ModelLoadError(
                f"layer_types={list(self.layer_types)!r} must name {_SLIDING!r} or {_FULL!r} for "
                f"each of the {self.num_hidden_layers} layers, with a sliding_window"
            )
        if self.sliding_window is not None:
            _require_positive("sliding_window", self.sliding_window)
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ModelLoadError(f"rope_scaling={self.rope_scaling!r} has no 'rope_type'")
        if not 0 < self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise ModelLoadError(
                f"partial_rotary_factor={self.partial_rotary_factor} gives {self.rotary_dim} "
                f"rotary dims of head_dim={self.head_dim} (needs an even count, at least 2)"
            )

    @property
    def o_proj_bias(self) -> bool:
        """o_proj has a bias: with attention_bias in the families that give it one (Llama,
        Qwen3, Gemma, Granite, OLMo 2, Cohere; not Qwen2, Mistral, StableLM, Phi-3)."""
        return self.attention_bias and self.architecture in family_config.O_BIAS_WITH_ATTENTION_BIAS

    @property
    def attention_sinks(self) -> bool:
        """Each attention has a learned per-head logit in its softmax's denominator (gpt-oss)."""
        return self.architecture in family_config.ATTENTION_SINKS

    @property
    def rotary_dim(self) -> int:
        """The dims of each head that rotary turns (the first ones; as transformers rounds)."""
        if self.kv_lora_rank:  # MLA: the cached head's first dims are its rotary key
            return self.qk_rope_head_dim
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kv_tensors_per_layer(self) -> int:
        """Cache tensors a layer needs: K and V, or one for MLA, whose values are the latent
        the keys hold (kiln.models.mla reads V from the same rows)."""
        return 1 if self.kv_lora_rank else 2

    def parameter_counts(self) -> dict[str, int]:
        """Weights per part of the model (no quantization): what a size check names."""
        kv_width = self.num_key_value_heads * self.head_dim
        attention = self.hidden_size * (self.num_attention_heads * self.head_dim) * 2
        attention += self.hidden_size * kv_width * 2
        if self.kv_lora_rank:
            shapes = mla_config.mla_attention_shapes(self)
            attention = sum(i * o for i, o in shapes) + mla_config.mla_unquantized_count(self)
        mlps = sum(self.mlp_parameter_count(i) for i in range(self.num_hidden_layers))
        embeddings = self.vocab_size * self.hidden_size
        return {
            "vocab_size": embeddings * (1 if self.tie_word_embeddings else 2),
            "num_hidden_layers": self.num_hidden_layers * attention + mlps,
        }

    def check_fits(self, bytes_per_weight: int, available_bytes: int, where: str) -> None:
        """ModelLoadError naming the field, before anything is allocated, if the weights alone
        need more than `available_bytes` (absurd sizes would hit the allocator or run for
        hours building ten million layers)."""
        counts = self.parameter_counts()
        need = sum(counts.values()) * bytes_per_weight
        if need <= available_bytes:
            return
        biggest = max(counts, key=counts.__getitem__)
        fields = {
            "vocab_size": f"vocab_size={self.vocab_size}, hidden_size={self.hidden_size}",
            "num_hidden_layers": f"num_hidden_layers={self.num_hidden_layers}, hidden_size="
            f"{self.hidden_size}, intermediate_size={self.intermediate_size}",
        }
        raise ModelLoadError(
            f"the model's weights need {need / 2**30:,.1f} GiB, more than the "
            f"{available_bytes / 2**30:,.1f} GiB of {where}: check {fields[biggest]}"
        )

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Parse an HF config.json dict (transformers 4.x or 5.x layout)."""
        architecture = _architecture_of(d)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if d.get(name) is None:
                raise ModelLoadError(f"config for {architecture!r} has no {name!r}")
        num_heads = _int(d, "num_attention_heads")
        hidden_size = _int(d, "hidden_size")
        if not d.get("head_dim") and num_heads > 0 and hidden_size % num_heads:
            # Else head_dim = hidden // heads silently drops columns (transformers refuses it).
            raise ModelLoadError(
                f"hidden_size={d['hidden_size']} is not divisible by num_attention_heads="
                f"{num_heads} (and the config gives no head_dim)"
            )
        rope_theta, rope_scaling = _rope_of(d)
        window, layer_types = attention_layout(architecture, d)
        fields: dict[str, Any] = dict(
            architecture=architecture,
            vocab_size=_int(d, "vocab_size"),
            hidden_size=hidden_size,
            intermediate_size=_int(d, "intermediate_size"),
            num_hidden_layers=_int(d, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=_opt_int(d, "num_key_value_heads") or num_heads,
            # Mistral configs sometimes carry "head_dim": null, hence `or`.
            head_dim=_opt_int(d, "head_dim") or hidden_size // max(num_heads, 1),
            rms_norm_eps=_float(d, "rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=_int(d, "max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; its config has no flag for them (Qwen3's has).
            attention_bias=architecture == "qwen2" or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=_as_ids(d.get("eos_token_id")),
            torch_dtype=_dtype_of(d),
            sliding_window=window,
            layer_types=layer_types,
            attn_logit_softcapping=_optional_float(d.get("attn_logit_softcapping")),
        )
        fields.update(family_config.family_fields(architecture, d))
        fields.update(moe_config.moe_fields(architecture, d))
        fields.update(mla_config.mla_fields(architecture, d))
        return cls(**fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict that transformers' config class of the architecture accepts.

        Rope settings are written both the transformers 4 way (rope_theta + rope_scaling) and the
        transformers 5 way (rope_parameters), so either version reads the same rotary embedding.
        """
        d: dict[str, Any] = {
            "architectures": [registry.hf_class_of(self.architecture)],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {
                **(self.rope_scaling or {"rope_type": "default"}),
                "rope_theta": self.rope_theta,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _ids_to_hf(self.eos_token_ids),
            "torch_dtype": self.torch_dtype,
            "dtype": self.torch_dtype,
            "sliding_window": self.sliding_window,
        }
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        if self.attn_logit_softcapping is not None:
            d["attn_logit_softcapping"] = self.attn_logit_softcapping
        if self.architecture in ("llama", "qwen3"):
            d["attention_bias"] = self.attention_bias
        if self.architecture == "llama":
            d["mlp_bias"] = False
        if self.architecture in _QWEN_WINDOWS:
            # Windowed from layer max_window_layers on (layer_types says the same, for HF 5).
            d["use_sliding_window"] = self.sliding_window is not None
            types = self.layer_types or (_SLIDING,) * self.num_hidden_layers
            first = types.index(_SLIDING) if _SLIDING in types else self.num_hidden_layers
            d["max_window_layers"] = first if self.sliding_window else self.num_hidden_layers
        d.update(family_config.family_hf_fields(self))
        d.update(moe_config.moe_hf_fields(self))
        d.update(mla_config.mla_hf_fields(self))
        return d


def _int(d: dict[str, Any], name: str, default: int = 0) -> int:
    """config.json's integer `name` (a float with an integral value, as 1e9, counts), or
    `default` when absent or null; anything else names the field."""
    value = _opt_int(d, name)
    return default if value is None else value


def _opt_int(d: dict[str, Any], name: str) -> int | None:
    value = d.get(name)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ModelLoadError(f"{name}={value!r} in the model's config is not an integer")
    return value


def _float(d: dict[str, Any], name: str, default: float) -> float:
    value = d.get(name, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value != value:
        raise ModelLoadError(f"{name}={value!r} in the model's config is not a number")
    return float(value)


def _require_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{name}={value!r} must be a positive integer")


def _architecture_of(d: dict[str, Any]) -> str:
    """The kiln architecture name, from `architectures` (preferred) or `model_type`."""
    classes = d.get("architectures") or []
    for cls in classes:
        architecture = registry.architecture_of_class(cls)
        if architecture is not None:
            return architecture
    model_type = d.get("model_type")
    if not classes and model_type is not None and registry.is_supported(model_type):
        return model_type
    named = classes[0] if classes else model_type
    raise ModelLoadError(
        f"unsupported architecture {named!r} (model_type={model_type!r}); "
        f"supported: {registry.supported_names()}"
    )


def _rope_of(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either layout.

    transformers 5 folds theta and scaling into one `rope_parameters` dict; transformers 4 has
    top-level `rope_theta` and `rope_scaling` (whose older files spell rope_type as "type").
    """
    params = d.get("rope_parameters") or {}
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3, transformers 5)
        params = params["full_attention"]
    source = d.get("rope_scaling") or params
    for name, value in (("rope_parameters", params), ("rope_scaling", source)):
        if not isinstance(value, dict):
            raise ModelLoadError(f"{name}={value!r} must be a dict (with a 'rope_type')")
    factor = source.get("factor")
    if factor is not None and (
        isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0
    ):
        raise ModelLoadError(f"rope_scaling.factor={factor!r} must be a positive number")
    theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
    rope_type = source.get("rope_type") or source.get("type") or "default"
    if rope_type == "default":
        return float(theta), None
    extra = {k: v for k, v in source.items() if k not in ("rope_theta", "type", "rope_type")}
    extra.pop("partial_rotary_factor", None)  # transformers 5 moves it here: a field of its own
    if d.get("original_max_position_embeddings"):  # Phi-3 keeps it beside rope_scaling
        extra.setdefault("original_max_position_embeddings", d["original_max_position_embeddings"])
    return float(theta), {"rope_type": rope_type, **extra}


def _as_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _ids_to_hf(ids: tuple[int, ...]) -> int | list[int] | None:
    if not ids:
        return None
    return ids[0] if len(ids) == 1 else list(ids)


def _dtype_of(d: dict[str, Any]) -> str:
    # transformers 5 writes "dtype", 4.x "torch_dtype"; a missing one means float32, as in HF.
    raw = d.get("dtype") or d.get("torch_dtype") or "float32"
    name = str(raw).removeprefix("torch.")
    name = _DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ModelLoadError(f"torch_dtype={raw!r} is not supported; expected one of {_DTYPES}")
    return name


_SLIDING, _FULL = "sliding_attention", "full_attention"
# Families whose window (when the config gives one) is every layer's.
_WINDOW_EVERYWHERE = ("mistral", "mixtral", "phi3", "starcoder2")
# Families with Qwen2's use_sliding_window / max_window_layers.
_QWEN_WINDOWS = ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe")
# Families that alternate local and global layers: every n-th layer (1-based) is global unless
# the config lists layer_types (Gemma 3's configs say sliding_window_pattern).
_GLOBAL_EVERY = {"gemma2": 2, "gemma3_text": 6, "gpt_oss": 2}


def attention_layout(architecture: str, d: dict[str, Any]) -> tuple[int | None, tuple | None]:
    """(sliding_window, layer_types) as transformers reads them: None layer_types when every
    layer has the window; no window when no layer has one."""
    window = d.get("sliding_window")
    if architecture == "llama" or window is None:
        return None, None
    num_layers = int(d["num_hidden_layers"])
    if architecture in _WINDOW_EVERYWHERE:
        return int(window), None
    types = d.get("layer_types")
    if architecture in _QWEN_WINDOWS:
        # Qwen2: no window unless use_sliding_window, and then from layer max_window_layers on.
        if not d.get("use_sliding_window", False):
            return None, None
        if types is None:
            first = int(d.get("max_window_layers", 0))
            types = [_SLIDING if i >= first else _FULL for i in range(num_layers)]
    elif types is None:
        every = int(d.get("sliding_window_pattern") or _GLOBAL_EVERY.get(architecture, 1))
        types = [_FULL if (i + 1) % every == 0 else _SLIDING for i in range(num_layers)]
    types = tuple(str(t) for t in types)
    if len(types) != num_layers or not set(types) <= {_SLIDING, _FULL}:
        raise ModelLoadError(
            f"layer_types={list(types)!r} must name {_SLIDING!r} or {_FULL!r} for each of the "
            f"{num_layers} layers"
        )
    if _SLIDING not in types:
        return None, None
    return int(window), None if set(types) == {_SLIDING} else types


def _optional_float(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ModelLoadError(f"a soft-cap of {value!r} must be a positive number")
    return float(value)


def _preset(
    architecture: str,
    vocab: int,
    hidden: int,
    ffn: int,
    layers: int,
    heads: int,
    kv_heads: int,
    **extra: Any,
) -> dict[str, Any]:
    """An HF config.json dict, with the fields every preset shares filled in."""
    return {
        "architectures": [registry.hf_class_of(architecture)],
        "model_type": architecture,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        **extra,
    }


_LLAMA3_EOS = [128001, 128008, 128009]  # <|end_of_text|>, <|eom_id|>, <|eot_id|> (Instruct)
_QWEN_IDS = {"bos_token_id": 151643, "eos_token_id": 151645}  # <|endoftext|>, <|im_end|>
_GPT_OSS = dict(
    head_dim=64, num_experts_per_tok=4, sliding_window=128, attention_bias=True,
    rms_norm_eps=1e-5, rope_theta=150000.0, max_position_embeddings=131072,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                  "truncate": False, "original_max_position_embeddings": 4096},
    swiglu_limit=7.0, bos_token_id=199998, eos_token_id=[200002, 199999, 200012],
    pad_token_id=199999,
)  # fmt: skip

# Published config.json shapes (the Instruct/Chat release where one exists, since that is what gets
# served), for building engines with dummy weights. Each parses with ModelConfig.from_hf_dict.
# fmt: off
PRESETS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": _preset(
        "llama", 128256, 4096, 14336, 32, 32, 8,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=_LLAMA3_EOS,
    ),
    # The 2/4/8-GPU benchmarks' model (docs/parallelism.md): 8 KV heads, so TP=8 splits them.
    "llama-3.1-70b": _preset(
        "llama", 128256, 8192, 28672, 80, 64, 8,
        rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        bos_token_id=128000, eos_token_id=_LLAMA3_EOS,
    ),
    "llama-3.2-1b": _preset(
        "llama", 128256, 2048, 8192, 16, 32, 8,
        head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
        tie_word_embeddings=True, bos_token_id=128000, eos_token_id=_LLAMA3_EOS,
    ),
    "llama-2-7b": _preset(
        "llama", 32000, 4096, 11008, 32, 32, 32,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, torch_dtype="float16",
    ),
    # v0.1, the release with a 4096-token sliding window (v0.3: vocab 32768, theta 1e6, no window).
    "mistral-7b": _preset(
        "mistral", 32000, 4096, 14336, 32, 32, 8,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=32768,
        sliding_window=4096, bos_token_id=1, eos_token_id=2,
    ),
    "qwen2.5-7b": _preset(
        "qwen2", 152064, 3584, 18944, 28, 28, 4,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=131072, use_sliding_window=False, max_window_layers=28, **_QWEN_IDS,
    ),
    "qwen2.5-0.5b": _preset(
        "qwen2", 151936, 896, 4864, 24, 14, 2,
        rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=32768,
        sliding_window=32768, use_sliding_window=False, max_window_layers=21,
        tie_word_embeddings=True, **_QWEN_IDS,
    ),
    "qwen3-8b": _preset(
        "qwen3", 151936, 4096, 12288, 36, 32, 8,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        use_sliding_window=False, max_window_layers=36, **_QWEN_IDS,
    ),
    "gemma-7b": _preset(
        "gemma", 256000, 3072, 24576, 28, 16, 16,
        head_dim=256, hidden_act="gelu_pytorch_tanh", rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=2, eos_token_id=1,
    ),
    # Gemma 2 9B: alternating 4096-token windows, attention and final logit soft-caps.
    "gemma-2-9b": _preset(
        "gemma2", 256000, 3584, 14336, 42, 16, 8,
        head_dim=256, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=[1, 107],
    ),
    # Gemma 3 12B (text): five 1024-token window layers to one global, two rope bases.
    "gemma-3-12b": _preset(
        "gemma3_text", 262208, 3840, 15360, 48, 16, 8,
        head_dim=256, hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh",
        query_pre_attn_scalar=256, sliding_window=1024, sliding_window_pattern=6,
        rope_theta=1000000.0, rope_local_base_freq=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0}, rms_norm_eps=1e-6,
        max_position_embeddings=131072, tie_word_embeddings=True, bos_token_id=2,
        eos_token_id=[1, 106],
    ),
    # Phi-4 (14B): Phi-3's architecture, no window, no longrope.
    "phi-4": _preset(
        "phi3", 100352, 5120, 17920, 40, 40, 10,
        rms_norm_eps=1e-5, rope_theta=250000.0, max_position_embeddings=16384,
        sliding_window=None, bos_token_id=100257, eos_token_id=100265,
    ),
    "smollm2-135m": _preset(
        "llama", 49152, 576, 1536, 30, 9, 3,
        rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    ),
    # The MoE benchmarks' models: 128 experts of 768, 8 a token (3.3B of 30.5B active); Mixtral's
    # 8 experts of 14336, 2 a token.
    "qwen3-30b-a3b": _preset(
        "qwen3_moe", 151936, 2048, 6144, 48, 32, 4,
        head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], use_sliding_window=False,
        max_window_layers=48, **_QWEN_IDS,
    ),
    "mixtral-8x7b": _preset(
        "mixtral", 32000, 4096, 14336, 32, 32, 8,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768,
        num_local_experts=8, num_experts_per_tok=2, sliding_window=None, bos_token_id=1,
        eos_token_id=2,
    ),
    # gpt-oss: alternating 128-token windows and full layers, attention sinks, yarn rope, every
    # layer 32 (120b: 128) experts of 2880 with biases and the clamped SwiGLU, 4 a token.
    "gpt-oss-20b": _preset(
        "gpt_oss", 201088, 2880, 2880, 24, 64, 8, **_GPT_OSS,
        num_local_experts=32,
    ),
    "gpt-oss-120b": _preset(
        "gpt_oss", 201088, 2880, 2880, 36, 64, 8, **_GPT_OSS,
        num_local_experts=128,
    ),
    # GLM-4.5-Air: the first layer dense, then 128 sigmoid-routed experts of 1408 (one group),
    # 8 a token, plus one shared; q/k/v biases, rotary on half of each 128-dim head.
    "glm-4.5-air": _preset(
        "glm4_moe", 151552, 4096, 10944, 46, 96, 8,
        head_dim=128, rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=131072,
        partial_rotary_factor=0.5, attention_bias=True, use_qk_norm=False,
        n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, pad_token_id=151329,
        eos_token_id=[151329, 151336, 151338],
    ),
    # DeepSeek-V3 (671B, 37B active): MLA (a 512-wide latent and a 64-dim rotary key cached per
    # token), three dense layers, then 256 sigmoid-routed experts of 2048 in 8 groups (4 kept),
    # 8 a token, plus one shared; yarn rope to 160k. Its multi-token-prediction layer is not run.
    "deepseek-v3": _preset(
        "deepseek_v3", 129280, 7168, 18432, 61, 128, 128,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048,
        n_shared_experts=1, first_k_dense_replace=3, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, rope_theta=10000.0,
        max_position_embeddings=163840, num_nextn_predict_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 1.0, "mscale_all_dim": 1.0,
                      "original_max_position_embeddings": 4096},
        bos_token_id=0, eos_token_id=1,
    ),
    # DeepSeek-V2-Lite (15.7B, 2.4B active): MLA without the query's low rank, one dense layer,
    # then 64 softmax-routed experts of 1408, 6 a token, plus two shared; one GPU's MLA model.
    "deepseek-v2-lite": _preset(
        "deepseek_v2", 102400, 2048, 10944, 27, 16, 16,
        q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, moe_intermediate_size=1408,
        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1,
        topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=False, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=163840,
        rope_scaling={"rope_type": "yarn", "factor": 40.0, "beta_fast": 32, "beta_slow": 1,
                      "mscale": 0.707, "mscale_all_dim": 0.707,
                      "original_max_position_embeddings": 4096},
        bos_token_id=100000, eos_token_id=100001,
    ),
    "tinyllama-1.1b": _preset(
        "llama", 32000, 2048, 5632, 22, 32, 4,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=2048,
        bos_token_id=1, eos_token_id=2,
    ),
}
# fmt: on
