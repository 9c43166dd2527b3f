"""The config.json fields of the mixture-of-experts families, read into ModelConfig's MoE fields
(and written back, so an engine directory's config round-trips): how many experts, how many a
token runs, their width, the routing's renormalisation, which layers are sparse and the shared
expert."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from kiln.errors import ModelLoadError

if TYPE_CHECKING:
    from kiln.models.config import ModelConfig

# Families whose every layer is sparse, each expert as wide as intermediate_size.
_MIXTRAL = ("mixtral",)
# Families with Qwen's moe_intermediate_size, decoder_sparse_step and mlp_only_layers.
_QWEN_MOE = ("qwen2_moe", "qwen3_moe")
# Families with DeepSeek-V3's MoE layers: sigmoid routing with a bias and groups, dense layers
# first, an ungated shared expert n_shared_experts wide.
_GLM_MOE = ("glm4_moe", "deepseek_v3")
# Families whose float8 experts carry a scale per output channel (gpt-oss: its MXFP4 experts
# convert to them exactly, kiln.checkpoint.fp4_formats); the others' one per expert.
PER_CHANNEL_EXPERTS = ("gpt_oss",)
# The config.json key an engine directory records per-channel experts under (a pre-quantized
# per-channel or per-tensor FP8 checkpoint's: their scales load into per-channel ones).
PER_CHANNEL_KEY = "kiln_per_channel_experts"


def moe_fields(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MoE fields of an HF config.json dict `d` of `architecture` ({} if dense)."""
    if architecture == "gpt_oss":  # every layer sparse, with biases and the clamped SwiGLU
        fields: dict[str, Any] = {
            "num_experts": int(d.get("num_local_experts", 128)),
            "moe_intermediate_size": int(d["intermediate_size"]),
            "norm_topk_prob": True,  # a softmax over the top-k logits
            "moe_bias": True,
            "swiglu_limit": float(d.get("swiglu_limit", 7.0)),
            "swiglu_alpha": float(d.get("swiglu_alpha", 1.702)),
            "attention_bias": bool(d.get("attention_bias", True)),  # q/k/v and o_proj
        }
    elif architecture in _MIXTRAL:
        fields = {
            "num_experts": int(d.get("num_local_experts", 8)),
            "moe_intermediate_size": int(d["intermediate_size"]),
            "norm_topk_prob": True,  # Mixtral's router always renormalises its top-k
        }
    elif architecture in _QWEN_MOE:
        fields = {
            "num_experts": int(d.get("num_experts") or d.get("num_local_experts") or 60),
            "moe_intermediate_size": int(d.get("moe_intermediate_size") or 0),
            "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(d.get("decoder_sparse_step") or 1),
            "mlp_only_layers": tuple(int(i) for i in d.get("mlp_only_layers") or ()),
        }
        if architecture == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = int(
                d.get("shared_expert_intermediate_size") or 0
            )
            fields["attention_bias"] = bool(d.get("qkv_bias", True))  # q/k/v only
    elif architecture in _GLM_MOE:
        fields = glm_moe_fields(d)
        if architecture == "deepseek_v3":  # its attention is MLA's (kiln.models.mla_config)
            for name in ("attention_bias", "qk_layernorm", "partial_rotary_factor"):
                del fields[name]
    elif architecture == "deepseek_v2":
        fields = deepseek_v2_moe_fields(d)
    else:
        return {}
    fields["num_experts_per_tok"] = int(d.get("num_experts_per_tok", 2))
    if not 0 < fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise ModelLoadError(
            f"num_experts_per_tok={fields['num_experts_per_tok']} must be 1 to the "
            f"{fields['num_experts']} experts"
        )
    if fields["moe_intermediate_size"] <= 0:
        raise ModelLoadError("an MoE config needs a positive moe_intermediate_size")
    fields["per_channel_experts"] = architecture in PER_CHANNEL_EXPERTS or bool(
        d.get(PER_CHANNEL_KEY)
    )
    return fields


def glm_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5's MoE fields, and its attention's options (q/k/v biases, per-head q/k RMSNorm,
    rotary on half of each head by default)."""
    moe_inter = int(d.get("moe_intermediate_size") or 0)
    n_group, topk_group = int(d.get("n_group") or 1), int(d.get("topk_group") or 1)
    num_experts = int(d.get("n_routed_experts") or 128)
    if num_experts % n_group or not 0 < topk_group <= n_group:
        raise ModelLoadError(
            f"n_routed_experts={num_experts} in n_group={n_group} groups with "
            f"topk_group={topk_group}: the groups must be equal and topk_group 1 to n_group"
        )
    params = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    return {
        "num_experts": num_experts,
        "moe_intermediate_size": moe_inter,
        "norm_topk_prob": bool(d.get("norm_topk_prob", True)),
        "shared_expert_intermediate_size": moe_inter * int(d.get("n_shared_experts", 1) or 0),
        "shared_expert_gated": False,
        "first_k_dense_replace": int(d.get("first_k_dense_replace", 1) or 0),
        "moe_routing": "sigmoid",
        "n_group": n_group,
        "topk_group": topk_group,
        "routed_scaling_factor": float(d.get("routed_scaling_factor", 1.0)),
        "attention_bias": bool(d.get("attention_bias", False)),  # q/k/v only
        "qk_layernorm": bool(d.get("use_qk_norm", False)),
        "partial_rotary_factor": float(
            d.get("partial_rotary_factor") or (params or {}).get("partial_rotary_factor") or 0.5
        ),
    }


def deepseek_v2_moe_fields(d: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2's MoE fields: softmax routing over every expert ("greedy", V2-Lite's), the
    top-k weights not renormalised; dense layers first, an ungated shared expert. Its
    "group_limited_greedy" routing over groups and a routed_scaling_factor other than 1 (the
    236B release's) kiln's softmax router does not compute: refused by name."""
    moe_inter = int(d.get("moe_intermediate_size") or 0)
    n_group = int(d.get("n_group") or 1)
    method = d.get("topk_method") or "greedy"
    scaling = float(d.get("routed_scaling_factor") or 1.0)
    if (method != "greedy" and n_group > 1) or scaling != 1.0:
        raise ModelLoadError(
            f"DeepSeek-V2's topk_method={method!r} with n_group={n_group} and "
            f"routed_scaling_factor={scaling}: kiln routes V2 by a softmax over every expert "
            "(topk_method 'greedy') with a scaling of 1 only"
        )
    if int(d.get("moe_layer_freq") or 1) != 1:
        raise ModelLoadError(f"moe_layer_freq={d['moe_layer_freq']}: kiln takes 1 only")
    return {
        "num_experts": int(d.get("n_routed_experts") or 64),
        "moe_intermediate_size": moe_inter,
        "norm_topk_prob": False,
        "shared_expert_intermediate_size": moe_inter * int(d.get("n_shared_experts", 2) or 0),
        "shared_expert_gated": False,
        "first_k_dense_replace": int(d.get("first_k_dense_replace", 0) or 0),
    }


# Schemes whose experts are 8-bit with a scale per output channel (kiln.layers.moe_w8a16).
PER_CHANNEL_8BIT = ("int8-w8a8", "int8-w8a16-channel", "fp8-w8a16-channel")
# ... and those of a scale per row and 128 inputs, as block FP8's (int8 W8A16 in groups of 128).
ROW_BLOCK_8BIT = ("fp8-block", "int8-w8a16-g128")


def expert_scale_count(cfg: ModelConfig, quantization: str = "fp8-dynamic") -> int:
    """The fp32 scales of one sparse layer's float8 experts: one per expert and projection, one
    per output channel (cfg.per_channel_experts), or under "fp8-block" one per row and 128
    inputs; INT4 experts' ("int4-g<N>", "int4-channel"): their scales and zero points; 8-bit
    weight-only and W8A8 INT8 experts' (PER_CHANNEL_8BIT): one per output channel
    ("int8-w8a16-g128": per row and 128 inputs)."""
    n, h = cfg.moe_intermediate_size, cfg.hidden_size
    if quantization.startswith("int4-"):  # a scale and a zero point per row and group
        # "int4-g<N>" / "int4-channel" (-sym); a build's "int4-gptq" / "int4-awq": groups of 128
        named = re.fullmatch(r"int4-(?:g(\d+)|(channel))(?:-sym)?", quantization)
        size = 128 if named is None else int(named.group(1) or 0)
        groups_n = n // (size or n) if n else 0  # a dense model has no expert inputs
        return 2 * cfg.num_held_experts * (2 * n * (h // (size or h)) + h * groups_n)
    if quantization in ("fp8-block", "int8-w8a16-g128"):  # a scale per row and 128 inputs
        return cfg.num_held_experts * (2 * n * -(-h // 128) + h * -(-n // 128))
    if cfg.per_channel_experts or quantization in PER_CHANNEL_8BIT:
        return cfg.num_held_experts * (2 * n + h)
    return 2 * cfg.num_held_experts


def moe_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields moe_fields reads, as transformers' config class of the family names them."""
    arch = cfg.architecture
    written = moe_family_hf_fields(cfg)
    if written and cfg.per_channel_experts and arch != "gpt_oss":
        written[PER_CHANNEL_KEY] = True
    return written


def _deepseek_expert_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The expert counts and sizes DeepSeek-V2's and GLM-4.5's configs name alike."""
    return {
        "n_routed_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "n_shared_experts": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
        "first_k_dense_replace": cfg.first_k_dense_replace,
    }


def moe_family_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    arch = cfg.architecture
    if arch == "gpt_oss":
        return {
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "swiglu_limit": cfg.swiglu_limit,
            "swiglu_alpha": cfg.swiglu_alpha,
            "attention_bias": cfg.attention_bias,
        }
    if arch in _MIXTRAL:
        return {
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
        }
    if arch == "deepseek_v2":
        return {
            **_deepseek_expert_fields(cfg),
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "routed_scaling_factor": 1.0,
        }
    if arch in _GLM_MOE:
        return {
            **_deepseek_expert_fields(cfg),
            "norm_topk_prob": cfg.norm_topk_prob,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "attention_bias": cfg.attention_bias,
            "use_qk_norm": cfg.qk_layernorm,
            "partial_rotary_factor": cfg.partial_rotary_factor,
        }
    if arch not in _QWEN_MOE:
        return {}
    d: dict[str, Any] = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
    }
    if arch == "qwen2_moe":
        d["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        d["qkv_bias"] = cfg.attention_bias
    else:
        d["attention_bias"] = cfg.attention_bias
    return d
