"""FP8 checkpoints users already have: what llm-compressor writes (compressed-tensors,
"float-quantized": per-channel or per-tensor float8 weights, activations per token at run time or
with a static per-tensor scale) and what NVIDIA ModelOpt exports (hf_quant_config.json, quant_algo
FP8: per-tensor `weight_scale` and `input_scale`, optionally the KV cache's `k_scale`/`v_scale`).

Both map onto kiln's FP8 W8A8 (kiln.layers.quantization.fp8): a per-tensor weight scale is a
per-channel one whose rows are equal, and the static input scales of q/k/v (or gate/up), which
share one input, become their fused projection's single scale (the largest, so none saturates
earlier than it did). Anything else a checkpoint declares (int4, NVFP4, block-wise FP8, a
quantized lm_head) is refused with what it is, never loaded as if it were unquantized.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any

from safetensors import safe_open

from kiln.errors import ModelLoadError

logger = logging.getLogger("kiln")

_FUSED = {  # an HF projection -> kiln's fused projection it loads into
    "q_proj": "qkv_proj",
    "k_proj": "qkv_proj",
    "v_proj": "qkv_proj",
    "o_proj": "o_proj",
    "gate_proj": "gate_up_proj",
    "up_proj": "gate_up_proj",
    "down_proj": "down_proj",
}
_INPUT_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.input_scale$")
# ModelOpt writes self_attn.k_proj.k_scale / v_proj.v_scale, compressed-tensors self_attn.k_scale.
_KV_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.)?([kv])_scale$")
# Modules a checkpoint may leave unquantized: kiln keeps them in the model dtype anyway (a
# mixture of experts' router, llm-compressor's "re:.*mlp.gate$", and Qwen2-MoE's shared-expert
# gate too).
_UNQUANTIZED_OK = ("lm_head", "model.embed_tokens", "embed_tokens", "mlp.gate", "mlp.gate$",
                   "block_sparse_moe.gate", "block_sparse_moe.gate$", "shared_expert_gate",
                   "shared_expert_gate$")  # fmt: skip


@dataclass(frozen=True)
class PrequantizedFp8:
    producer: str  # "compressed-tensors" or "modelopt"
    quantization: str  # kiln's scheme: "fp8-dynamic" or "fp8" (static input scales)
    input_scales: dict[str, float] | None  # "fp8": kiln layer name -> scale
    # Per layer (k_scale, v_scale) of the float8 KV cache, when the checkpoint has them: folded
    # into the model (kiln.models.kv_scales) when the cache is float8, else unused.
    kv_scales: list[tuple[float, float]] | None


def read_prequantized(path: str, config: dict[str, Any]) -> PrequantizedFp8 | None:
    """The FP8 scheme an HF checkpoint directory declares, or None for an unquantized one."""
    modelopt_file = os.path.join(path, "hf_quant_config.json")
    declared = config.get("quantization_config")
    if os.path.isfile(modelopt_file):
        with open(modelopt_file, encoding="utf-8") as f:
            return _modelopt(path, json.load(f).get("quantization", {}))
    if declared is None:
        return None
    method = declared.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(path, declared)
    if method == "modelopt":
        return _modelopt(path, declared)
    if method == "fp8":  # vLLM / HF's own FP8 config: block-wise or per-tensor
        raise ModelLoadError(
            f"{path}: quant_method 'fp8' checkpoints are not supported (kiln loads "
            "compressed-tensors and ModelOpt FP8; or load the unquantized checkpoint with "
            "--quantization fp8-dynamic)"
        )
    raise ModelLoadError(
        f"{path}: quantization {method!r} is not supported; kiln loads FP8 checkpoints from "
        "llm-compressor (compressed-tensors) and NVIDIA ModelOpt"
    )


def _compressed_tensors(path: str, declared: dict[str, Any]) -> PrequantizedFp8:
    groups = declared.get("config_groups") or {}
    if declared.get("format") not in ("float-quantized", None) or len(groups) != 1:
        raise ModelLoadError(
            f"{path}: compressed-tensors format {declared.get('format')!r} with {len(groups)} "
            "config groups is not supported (kiln loads one float-quantized FP8 group)"
        )
    (group,) = groups.values()
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    fp8 = [q.get("type") == "float" and q.get("num_bits") == 8 for q in (weights, inputs)]
    if not all(fp8) or weights.get("strategy") not in ("channel", "tensor"):
        raise ModelLoadError(
            f"{path}: compressed-tensors scheme {_describe(weights)} weights / "
            f"{_describe(inputs)} activations is not supported (kiln loads FP8 weights per "
            "channel or tensor with FP8 activations)"
        )
    check_ignored(path, declared.get("ignore") or [], group.get("targets") or [])
    kv_scales = _kv_scales(path) if declared.get("kv_cache_scheme") else None
    if inputs.get("dynamic"):
        if inputs.get("strategy") != "token":
            raise ModelLoadError(
                f"{path}: dynamic activations per {inputs.get('strategy')!r} are not supported "
                "(kiln quantizes activations per token)"
            )
        return PrequantizedFp8("compressed-tensors", "fp8-dynamic", None, kv_scales)
    if inputs.get("strategy") != "tensor":
        raise ModelLoadError(f"{path}: static activation scales must be per tensor")
    return PrequantizedFp8("compressed-tensors", "fp8", _input_scales(path), kv_scales)


def _modelopt(path: str, quant: dict[str, Any]) -> PrequantizedFp8:
    algo = quant.get("quant_algo")
    if algo != "FP8":
        raise ModelLoadError(
            f"{path}: ModelOpt quant_algo {algo!r} is not supported (kiln loads quant_algo FP8)"
        )
    kv_algo = quant.get("kv_cache_quant_algo")
    if kv_algo not in (None, "FP8"):
        raise ModelLoadError(f"{path}: ModelOpt kv_cache_quant_algo {kv_algo!r} is not supported")
    excluded = quant.get("exclude_modules") or quant.get("ignore") or []
    check_ignored(path, excluded, ["Linear"])
    kv_scales = _kv_scales(path) if kv_algo == "FP8" else None
    return PrequantizedFp8("modelopt", "fp8", _input_scales(path), kv_scales)


def check_ignored(path: str, ignored: list[str], targets: list[str]) -> None:
    """kiln quantizes the decoder's projections and nothing else: lm_head must be left out."""
    if "Linear" not in targets:
        raise ModelLoadError(f"{path}: quantization targets {targets} (kiln expects 'Linear')")
    if not any(name.endswith("lm_head") for name in ignored):
        raise ModelLoadError(
            f"{path}: its lm_head is quantized; kiln keeps the LM head in the model dtype "
            "(quantize with lm_head ignored)"
        )
    unknown = [n for n in ignored if not n.endswith(_UNQUANTIZED_OK)]
    if unknown:
        raise ModelLoadError(
            f"{path}: layers left unquantized ({unknown[:3]}...) are not supported: kiln "
            "quantizes every decoder projection alike"
        )


def _input_scales(path: str) -> dict[str, float]:
    """Every projection's static input scale, read from the checkpoint's files before the model
    is built (its linear methods take them at construction): the largest of the shards a fused
    projection is made of."""
    scales: dict[str, float] = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                match = _INPUT_SCALE_RE.match(name)
                if match is None:
                    continue
                layer, block, proj = match.groups()
                if proj not in _FUSED:
                    raise ModelLoadError(f"{path}: unexpected tensor {name!r}")
                key = f"layers.{layer}.{block}.{_FUSED[proj]}"
                value = float(f.get_tensor(name).float().max())
                scales[key] = max(scales.get(key, 0.0), value)
    if not scales:
        raise ModelLoadError(f"{path}: a static FP8 checkpoint without input_scale tensors")
    return scales


def _kv_scales(path: str) -> list[tuple[float, float]] | None:
    """Each layer's (k_scale, v_scale), or None (with a warning) when the checkpoint declares a
    float8 KV cache but holds no scale for some layer."""
    found: dict[tuple[int, str], float] = {}
    for file in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
        with safe_open(os.path.join(path, file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                match = _KV_SCALE_RE.match(name)
                if match is not None:
                    found[int(match.group(1)), match.group(2)] = float(f.get_tensor(name).max())
    layers = 1 + max((layer for layer, _ in found), default=-1)
    if not layers or any((i, kv) not in found for i in range(layers) for kv in "kv"):
        logger.warning("%s: KV cache scales incomplete: its float8 cache stays unscaled", path)
        return None
    return [(found[i, "k"], found[i, "v"]) for i in range(layers)]


def _describe(q: dict[str, Any]) -> str:
    return f"{q.get('type')}{q.get('num_bits')}/{q.get('strategy')}"
