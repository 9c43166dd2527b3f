"""SmoothQuant-style smoothing for FP8 W8A8 (Xiao et al., 2022, "SmoothQuant"): divide each input
channel j of a projection by s_j and multiply the weight's column j by s_j, so the product is
unchanged while the activations' outlier channels shrink and the weights (quantized per output
row, where a column's growth costs little) take part of their range:

    s_j = amax_x_j ** alpha / amax_w_j ** (1 - alpha)

amax_x_j over the calibration text, amax_w_j over the weight's rows. The division is folded
exactly into the op before the projection, so the engine format and every kernel stay as they
are; only the weights written change:

  qkv_proj's input     = RMSNorm(x) * g        -> g / s   (input_layernorm)
  gate_up_proj's input = RMSNorm(x) * g        -> g / s   (post_attention_layernorm)
                         (a LayerNorm's bias too: LayerNorm(x) * g + b -> g / s, b / s; a
                         parallel layer's one norm feeds both, so they share one s: the max of
                         their inputs' amax over the max of their weights')
  down_proj's input    = SiLU(gate) * up       -> up's rows / s (linear in up)
  o_proj's input       = softmax(qk) v per head -> v_proj's rows / s (linear in v), with one s
                         per (KV head, dim): query heads sharing a KV head (GQA) share its v, so
                         their o_proj columns take that KV head's factor

smooth_checkpoint applies this to the source's Hugging Face-named tensors as they stream into the
build's model (whole tensors, before any tensor-parallel cut); the embedding, the final norm and
the LM head (tied or not) are untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import torch

from kiln.models.base import CausalLM
from kiln.models.blocks import GatedMLP, decoder_layers
from kiln.models.config import ModelConfig

# The projections whose input can be divided exactly by the op before them.
KINDS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
# Per activation scheme, chosen on SmolLM2's calibration split outside the calibration windows:
# per-token scales take a strong migration; one static scale per tensor a mild one, since
# smoothing flattens the channels' amax and so takes away the headroom that unseen text's larger
# values need. INT8 per token takes SmoothQuant's own default, block FP8 (scales per group of
# 128 inputs) fp8-dynamic's; neither chosen on SmolLM2 yet.
DEFAULT_ALPHA = {"fp8-dynamic": 0.7, "fp8": 0.3, "int8-w8a8": 0.5, "fp8-block": 0.7}
_FLOOR = 1e-5  # a channel never seen, or a weight column of zeros: no factor from it


@dataclass(frozen=True)
class SmoothingSpec:
    """A parsed `--smoothing` value: "none", or "smoothquant[:alpha]" with 0 <= alpha <= 1."""

    method: str
    alpha: float | None = None

    @classmethod
    def parse(cls, text: str, quantization: str = "fp8-dynamic") -> SmoothingSpec:
        """`quantization` picks the default alpha (DEFAULT_ALPHA) when `text` names none."""
        method, _, alpha_text = text.partition(":")
        if method == "none" and not alpha_text:
            return cls("none")
        if method != "smoothquant":
            raise ValueError(f"smoothing must be none or smoothquant[:alpha], got {text!r}")
        if not alpha_text:
            return cls("smoothquant", DEFAULT_ALPHA.get(quantization, DEFAULT_ALPHA["fp8"]))
        try:
            alpha = float(alpha_text)
        except ValueError:
            raise ValueError(
                f"smoothing alpha must be a number in [0, 1], got {alpha_text!r}"
            ) from None
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"smoothing alpha must be in [0, 1], got {alpha}")
        return cls("smoothquant", alpha)

    def __str__(self) -> str:  # the canonical form: what the manifest and the engine id hold
        return "none" if self.method == "none" else f"smoothquant:{self.alpha:g}"


def smoothing_factors(
    model: CausalLM, input_amax: dict[str, torch.Tensor], alpha: float
) -> dict[str, torch.Tensor]:
    """Layer name ("layers.3.mlp.down_proj") -> its [in_features] fp32 factors s, from the
    unquantized, unsharded `model`'s weights and its inputs' per-channel amax (as
    calibrate_channel_amax makes them)."""
    if model.parallel is not None:
        raise ValueError("smoothing factors come from the whole (unsharded) model")
    if not getattr(model, "supports_smoothing", True):
        raise ValueError(
            f"smoothing folds into Llama-shaped RMSNorm layers; {model.config.architecture}'s "
            "norms or checkpoint names differ"
        )
    factors = {}
    for i, layer in enumerate(decoder_layers(model)):
        attn, mlp = layer.self_attn, layer.mlp
        if not isinstance(mlp, GatedMLP):
            raise ValueError(f"smoothing folds into a gated MLP's norm, not {type(mlp).__name__}")
        if layer.parallel:  # one norm before both: one factor for both (the module docstring)
            projs = (attn.qkv_proj, mlp.gate_up_proj)
            names = [_layer_name(f"layers.{i}", kind) for kind in ("qkv_proj", "gate_up_proj")]
            x_amax = torch.maximum(*(input_amax[n].float() for n in names)).clamp(min=_FLOOR)
            w_amax = torch.maximum(*(p.weight.detach().abs().amax(dim=0).float().cpu()
                                     for p in projs)).clamp(min=_FLOOR)  # fmt: skip
            shared = (x_amax.pow(alpha) / w_amax.pow(1.0 - alpha)).clamp(_FLOOR, 1.0 / _FLOOR)
            factors.update(dict.fromkeys(names, shared))
        for kind, proj in (
            ("qkv_proj", attn.qkv_proj),
            ("o_proj", attn.o_proj),
            ("gate_up_proj", mlp.gate_up_proj),
            ("down_proj", mlp.down_proj),
        ):
            name = _layer_name(f"layers.{i}", kind)
            if name in factors:
                continue
            x_amax = input_amax[name].float().clamp(min=_FLOOR)
            w_amax = proj.weight.detach().abs().amax(dim=0).float().cpu().clamp(min=_FLOOR)
            if kind == "o_proj":  # one factor per (KV head, dim): see the module docstring
                x_amax = _kv_group_max(x_amax, attn.num_heads, attn.num_kv_heads, attn.head_dim)
                w_amax = _kv_group_max(w_amax, attn.num_heads, attn.num_kv_heads, attn.head_dim)
            s = x_amax.pow(alpha) / w_amax.pow(1.0 - alpha)
            factors[name] = s.clamp(min=_FLOOR, max=1.0 / _FLOOR)
    return factors


def _kv_group_max(v: torch.Tensor, heads: int, kv_heads: int, head_dim: int) -> torch.Tensor:
    """[heads * head_dim] -> the same, each value the max over the query heads that share its
    KV head (query head h reads KV head h // (heads / kv_heads), as the attention kernels do)."""
    grouped = v.view(kv_heads, heads // kv_heads, head_dim).amax(dim=1, keepdim=True)
    return grouped.expand(kv_heads, heads // kv_heads, head_dim).reshape(-1)


def _per_kv_row(s_o: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """o_proj's [heads * head_dim] factors (equal within a KV group) -> v_proj's rows'."""
    kv, group = cfg.num_key_value_heads, cfg.num_attention_heads // cfg.num_key_value_heads
    return s_o.view(kv, group, cfg.head_dim)[:, 0, :].reshape(-1)


def smooth_checkpoint(
    weights: Iterable[tuple[str, torch.Tensor]],
    factors: dict[str, torch.Tensor],
    cfg: ModelConfig,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The source's Hugging Face-named tensors, each decoder layer's smoothed with `factors`
    (smoothing_factors'); the changed ones in fp32 (the quantizer reads them unrounded), the
    others as they come."""
    for hf_name, tensor in weights:
        parts = hf_name.split(".")
        if len(parts) < 4 or parts[:2] != ["model", "layers"]:
            yield hf_name, tensor
            continue
        prefix, key = f"layers.{parts[2]}", ".".join(parts[3:])
        layer = {kind: factors[_layer_name(prefix, kind)] for kind in KINDS}
        out = _smooth_tensor(key, tensor, layer.__getitem__, cfg)
        yield hf_name, tensor if out is None else out


def _layer_name(prefix: str, kind: str) -> str:
    return f"{prefix}.{'self_attn' if kind in ('qkv_proj', 'o_proj') else 'mlp'}.{kind}"


def _smooth_tensor(
    key: str, tensor: torch.Tensor, s: Callable[[str], torch.Tensor], cfg: ModelConfig
) -> torch.Tensor | None:
    """One decoder-layer tensor ("self_attn.v_proj.weight", ...) smoothed, or None: unchanged."""
    t = tensor.float()
    if key in ("input_layernorm.weight", "input_layernorm.bias"):
        return t / s("qkv_proj").to(t.device)
    if key in ("post_attention_layernorm.weight", "post_attention_layernorm.bias"):
        return t / s("gate_up_proj").to(t.device)
    if key in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
        return t * s("qkv_proj").to(t.device)
    if key == "self_attn.v_proj.weight":  # columns by qkv's input factors, rows by o_proj's
        rows = _per_kv_row(s("o_proj"), cfg).to(t.device)
        return t * s("qkv_proj").to(t.device) / rows[:, None]
    if key == "self_attn.v_proj.bias":
        return t / _per_kv_row(s("o_proj"), cfg).to(t.device)
    if key == "self_attn.o_proj.weight":
        return t * s("o_proj").to(t.device)
    if key == "mlp.gate_proj.weight":
        return t * s("gate_up_proj").to(t.device)
    if key == "mlp.up_proj.weight":  # columns by gate_up's input factors, rows by down_proj's
        return t * s("gate_up_proj").to(t.device) / s("down_proj").to(t.device)[:, None]
    if key == "mlp.down_proj.weight":
        return t * s("down_proj").to(t.device)
    return None  # q/k biases (the output is unchanged), rotary buffers
