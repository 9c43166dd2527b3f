"""The config.json fields of multi-head latent attention (DeepSeek-V2 / V3), read into
ModelConfig's MLA fields and written back: the query's and the keys' low ranks, each head's
rotary, non-rotary and value widths. What the paged cache holds per token is one "KV head"
of the latent and the shared rotary key, so `head_dim` and `num_key_value_heads` become that
head's (kv_lora_rank + qk_rope_head_dim wide, one of it)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from kiln.errors import ModelLoadError

if TYPE_CHECKING:
    from kiln.models.config import ModelConfig

MLA_FAMILIES = ("deepseek_v2", "deepseek_v3")


def mla_fields(architecture: str, d: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's MLA fields of an HF config.json dict `d` ({} for other families)."""
    if architecture not in MLA_FAMILIES:
        return {}
    q_lora = d.get("q_lora_rank")
    fields: dict[str, Any] = {
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "kv_lora_rank": int(d.get("kv_lora_rank") or 512),
        "qk_nope_head_dim": int(d.get("qk_nope_head_dim") or 128),
        "qk_rope_head_dim": int(d.get("qk_rope_head_dim") or 64),
        "v_head_dim": int(d.get("v_head_dim") or 128),
        "attention_bias": bool(d.get("attention_bias", False)),
        # DeepSeek-V2 always pairs rotary dims (2i, 2i+1); V3 unless rope_interleave is off.
        "rope_interleave": architecture == "deepseek_v2" or bool(d.get("rope_interleave", True)),
        "partial_rotary_factor": 1.0,
    }
    for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        if fields[name] <= 0:
            raise ModelLoadError(f"{name}={fields[name]} must be positive")
    if fields["qk_rope_head_dim"] % 2:
        raise ModelLoadError(f"qk_rope_head_dim={fields['qk_rope_head_dim']} must be even")
    if fields["attention_bias"] and fields["q_lora_rank"] is None:
        raise ModelLoadError("attention_bias without q_lora_rank (a q_proj without a bias)")
    if fields["q_lora_rank"] is not None and fields["q_lora_rank"] <= 0:
        raise ModelLoadError(f"q_lora_rank={fields['q_lora_rank']} must be positive or null")
    # The cache's one head: [rotary key | latent] per token, shared by every query head.
    fields["head_dim"] = fields["kv_lora_rank"] + fields["qk_rope_head_dim"]
    fields["num_key_value_heads"] = 1
    return fields


def mla_hf_fields(cfg: ModelConfig) -> dict[str, Any]:
    """The fields mla_fields reads, as transformers' DeepseekV2/V3Config names them (HF's
    num_key_value_heads is the query heads': it expands the latent per head)."""
    if not cfg.kv_lora_rank:
        return {}
    return {
        "q_lora_rank": cfg.q_lora_rank,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "head_dim": cfg.qk_rope_head_dim,
        "num_key_value_heads": cfg.num_attention_heads,
        "attention_bias": cfg.attention_bias,
        "rope_interleave": cfg.rope_interleave,
    }


def mla_softmax_scale(cfg: ModelConfig) -> float:
    """1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times yarn's mscale(factor,
    mscale_all_dim) squared when the rope scaling gives mscale_all_dim (transformers'
    yarn_apply_mscale: DeepSeek scales the non-rotary dims' logits too)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    all_dim = scaling.get("mscale_all_dim")
    if scaling.get("rope_type", "default") != "default" and all_dim:
        factor = float(scaling["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * float(all_dim) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


def mla_attention_shapes(cfg: ModelConfig) -> list[tuple[int, int]]:
    """(in, out) of one layer's MLA projections that a quantization method may take: the
    query's (q_a, q_b; or q_proj), kv_a_proj_with_mqa and o_proj. kv_b_proj (kv_lora_rank ->
    heads * (qk_nope + v)) stays in the model dtype: its halves are absorbed into the query and
    the output (kiln.models.mla)."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    if cfg.q_lora_rank is None:
        query = [(h, heads * qk)]
    else:
        query = [(h, cfg.q_lora_rank), (cfg.q_lora_rank, heads * qk)]
    kv_a = (h, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    return [*query, kv_a, (heads * cfg.v_head_dim, h)]


def mla_unquantized_count(cfg: ModelConfig) -> int:
    """One layer's MLA parameters outside the projections of mla_attention_shapes: kv_b_proj's
    weight and the two low-rank norms."""
    heads = cfg.num_attention_heads
    kv_b = cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    return kv_b + cfg.kv_lora_rank + (cfg.q_lora_rank or 0)


def check_mla_kv_cache(cfg: ModelConfig, kv_cache_dtype: str, error: type[Exception]) -> None:
    """Refuses an int8 KV cache for multi-head latent attention: int8 codes need scales folded
    into the weights, and the latent rows (one tensor for K and V, written after a norm) have
    no block that folds them (kiln.models.kv_scales); a float8 cache holds them unscaled."""
    if cfg.kv_lora_rank and kv_cache_dtype == "int8":
        raise error(
            f"{cfg.architecture}: an int8 KV cache is not supported with multi-head latent "
            "attention (its latent rows take no int8 scales); use --kv-cache-dtype fp8 or auto"
        )
