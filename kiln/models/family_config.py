"""The config.json fields of the families beyond Llama's block shape, each read into the block
options of ModelConfig (and written back, so an engine directory's config round-trips): the
activation, biases, partial rotary, multipliers, norms and residual shape, by family."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kiln.errors import ModelLoadError

if TYPE_CHECKING:
    from kiln.models.config import ModelConfig

# The gated MLP's activations kiln has kernels for (kiln.models.blocks.GatedMLP).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
# Families whose o_proj has a bias when attention_bias is set (Qwen2's and Mistral's never has).
# The Gemma generations: sqrt(hidden)-scaled embeddings, (1 + w) norms, tied by default.
GEMMA = ("gemma", "gemma2", "gemma3_text")
O_BIAS_WITH_ATTENTION_BIAS = (
    "llama",
    "qwen3",
    "qwen3_moe",
    "granite",
    "olmo2",
    "cohere",
    "starcoder2",
    "gpt_oss",
    *GEMMA,
)
# Families whose attention adds a learned per-head logit to each softmax's denominator.
ATTENTION_SINKS = ("gpt_oss",)
# Families that tie the LM head to the embedding unless config.json says otherwise.
_TIED_BY_DEFAULT = ("cohere", "starcoder2", *GEMMA)


def family_fields(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig fields (overriding the shared ones where a family names them otherwise) of
    an HF config.json dict `d` of `architecture`."""
    raw = d.get("rope_parameters")
    params: dict[str, Any] = raw if isinstance(raw, dict) else {}
    local = params.get("sliding_attention")  # per layer type (Gemma 3, transformers 5)
    local_base = local.get("rope_theta") if isinstance(local, dict) else None
    act = d.get("hidden_activation") or d.get("hidden_act") or "silu"
    if architecture in GEMMA and act == "gelu":  # Gemma's legacy spelling, as transformers reads it
        act = "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"hidden_act={act!r} is not supported; supported: {ACTIVATIONS}")
    fields: dict[str, Any] = {
        "hidden_act": act,
        "mlp_bias": bool(d.get("mlp_bias", False)),
        "partial_rotary_factor": float(
            d.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0
        ),
        "final_logit_softcapping": _optional_float(d.get("final_logit_softcapping")),
        "rope_local_base_freq": _optional_float(d.get("rope_local_base_freq") or local_base),
    }
    if d.get("query_pre_attn_scalar"):  # Gemma 2/3
        fields["attention_multiplier"] = float(d["query_pre_attn_scalar"]) ** -0.5
    if architecture in _TIED_BY_DEFAULT:
        fields["tie_word_embeddings"] = bool(d.get("tie_word_embeddings", True))
    if architecture in GEMMA:
        fields["embedding_multiplier"] = float(d["hidden_size"]) ** 0.5
    elif architecture == "granite":
        fields["embedding_multiplier"] = float(d.get("embedding_multiplier", 1.0))
        fields["residual_multiplier"] = float(d.get("residual_multiplier", 1.0))
        fields["attention_multiplier"] = float(d.get("attention_multiplier", 1.0))
        fields["logits_multiplier"] = 1.0 / float(d.get("logits_scaling", 1.0))
    elif architecture == "stablelm":
        fields["rms_norm_eps"] = float(d.get("layer_norm_eps", 1e-5))
        fields["attention_bias"] = bool(d.get("use_qkv_bias", False))
        fields["qk_layernorm"] = bool(d.get("qk_layernorm", False))
        fields["parallel_residual"] = bool(d.get("use_parallel_residual", False))
    elif architecture == "starcoder2":  # one use_bias for every projection
        fields["rms_norm_eps"] = float(d.get("norm_epsilon", 1e-5))
        bias = bool(d.get("use_bias", True))
        fields.update(attention_bias=bias, mlp_bias=bias)
    elif architecture == "cohere":
        fields["rms_norm_eps"] = float(d.get("layer_norm_eps", 1e-5))
        fields["logits_multiplier"] = float(d.get("logit_scale", 1.0))
        fields["qk_layernorm"] = bool(d.get("use_qk_norm", False))
        fields["parallel_residual"] = True
    return fields


def family_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields family_fields reads, as transformers' config class of the family names them."""
    arch = cfg.architecture
    d: dict[str, Any] = {"hidden_act": cfg.hidden_act}
    if cfg.partial_rotary_factor != 1.0:
        d["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.final_logit_softcapping is not None:
        d["final_logit_softcapping"] = cfg.final_logit_softcapping
    if cfg.rope_local_base_freq is not None:
        d["rope_local_base_freq"] = cfg.rope_local_base_freq
        d["rope_parameters"] = {  # transformers 5: one per layer type
            "full_attention": {**(cfg.rope_scaling or {"rope_type": "default"}),
                               "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_local_base_freq},
        }  # fmt: skip
    if arch in ("llama", "granite"):
        d["mlp_bias"] = cfg.mlp_bias
    if arch in ("granite", "olmo2", "cohere", "phi3", *GEMMA):
        d["attention_bias"] = cfg.attention_bias
    if arch in GEMMA:
        d["hidden_activation"] = cfg.hidden_act
    if cfg.attention_multiplier is not None and arch in GEMMA:
        scalar = cfg.attention_multiplier**-2  # transformers' config types it as an int
        d["query_pre_attn_scalar"] = round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar
    if arch == "granite":
        d["embedding_multiplier"] = cfg.embedding_multiplier
        d["residual_multiplier"] = cfg.residual_multiplier
        d["attention_multiplier"] = cfg.attention_multiplier
        d["logits_scaling"] = 1.0 / cfg.logits_multiplier
    original = (cfg.rope_scaling or {}).get("original_max_position_embeddings")
    if arch == "phi3" and original:
        d["original_max_position_embeddings"] = original
    if arch in ("stablelm", "cohere"):
        d["layer_norm_eps"] = cfg.rms_norm_eps
    if arch == "stablelm":
        d["use_qkv_bias"] = cfg.attention_bias
        d["qk_layernorm"] = cfg.qk_layernorm
        d["use_parallel_residual"] = cfg.parallel_residual
    if arch == "starcoder2":
        d["norm_epsilon"] = cfg.rms_norm_eps
        d["use_bias"] = cfg.attention_bias
    if arch == "cohere":
        d["logit_scale"] = cfg.logits_multiplier
        d["use_qk_norm"] = cfg.qk_layernorm
    return d


def _optional_float(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ModelLoadError(f"{value!r} is not a number")
    return float(value)
