"""8-bit checkpoints users already have, beyond per-channel / per-tensor FP8 (prequantized.py):

- FP8 with 128x128 weight blocks: DeepSeek-V3's and Qwen3's releases (`quant_method: fp8`,
  `weight_block_size: [128, 128]`, each weight's block scales in `weight_scale_inv`, multiplied
  despite the name) and llm-compressor's FP8_BLOCK (compressed-tensors `float-quantized`,
  `strategy: block`, `weight_scale`) -> kiln's "fp8-block";
- W8A8 INT8: compressed-tensors `int-quantized`, int8 weights per channel, int8 activations per
  token at run time (SmoothQuant's, smoothing folded in already) -> "int8-w8a8";
- weight-only 8-bit: compressed-tensors W8A16 (`pack-quantized` int8, four codes an int32 word)
  and float8 weight-only (`naive-quantized`), per channel or per group of inputs ->
  "int8-w8a16-<g N | channel>" / "fp8-w8a16-...".

Each tensor converts on its own as it streams past (eight_bit_tensors): block and group scales
become `weight_scales` (the layer repeats block scales down their rows), packed int8 codes an
int8 `weight`. What else a compressed-tensors checkpoint declares is left to the other readers.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError

# Modules a checkpoint may leave unquantized: kiln keeps them in the model dtype anyway (a
# mixture of experts' router, `mlp.gate` (Mixtral's `block_sparse_moe.gate`), and Qwen2-MoE's
# shared-expert gate too).
_NOT_CONVERTED_OK = ("lm_head", "embed_tokens", "mlp.gate", "block_sparse_moe.gate",
                     "shared_expert_gate")  # fmt: skip


@dataclass(frozen=True)
class PrequantizedEightBit:
    producer: str  # "compressed-tensors" or "fp8" (the DeepSeek / Qwen release format)
    quantization: str  # kiln's scheme (kiln.layers.quantization.linear_method_factory)


def read_eight_bit(path: str, config: dict[str, Any]) -> PrequantizedEightBit | None:
    """The 8-bit scheme an HF checkpoint's config.json declares, or None for any other."""
    declared = config.get("quantization_config") or {}
    method = declared.get("quant_method")
    if method == "fp8":
        return _fp8_release(path, declared)
    if method != "compressed-tensors":
        return None
    groups = declared.get("config_groups") or {}
    if len(groups) != 1:
        return None  # the other readers say what they take
    (group,) = groups.values()
    weights, inputs = group.get("weights") or {}, group.get("input_activations") or {}
    if weights.get("num_bits") != 8:
        return None
    scheme = _ct_scheme(path, weights, inputs)
    if scheme is None:
        return None
    from kiln.checkpoint.prequantized import check_ignored

    check_ignored(path, declared.get("ignore") or [], group.get("targets") or [])
    return PrequantizedEightBit("compressed-tensors", scheme)


def _fp8_release(path: str, declared: dict[str, Any]) -> PrequantizedEightBit:
    block = declared.get("weight_block_size")
    scheme = declared.get("activation_scheme", "dynamic")
    fmt = declared.get("fmt", "e4m3")
    if block is None or list(block) != [128, 128] or scheme != "dynamic" or fmt != "e4m3":
        raise ModelLoadError(
            f"{path}: quant_method 'fp8' ({fmt}) with weight_block_size {block} and {scheme} "
            "activations is not supported (kiln loads e4m3 in 128x128 blocks with dynamic "
            "activations, DeepSeek's and Qwen's FP8 format; or load the unquantized checkpoint "
            "with --quantization fp8-dynamic)"
        )
    kept = declared.get("modules_to_not_convert") or []
    unknown = [m for m in kept if not m.endswith(_NOT_CONVERTED_OK)]
    if unknown:
        raise ModelLoadError(
            f"{path}: modules_to_not_convert {unknown[:3]} are not supported: kiln quantizes "
            "every decoder projection alike"
        )
    return PrequantizedEightBit("fp8", "fp8-block")


def _ct_scheme(path: str, weights: dict[str, Any], inputs: dict[str, Any]) -> str | None:
    """kiln's scheme for one compressed-tensors group of 8-bit weights, None for per-channel /
    per-tensor FP8 W8A8 (prequantized.py's); an 8-bit scheme kiln cannot run is refused."""
    kind, strategy = weights.get("type"), weights.get("strategy")
    described = f"{kind}8/{strategy} weights, {_describe(inputs)} activations"
    if not weights.get("symmetric", True):
        raise ModelLoadError(f"{path}: asymmetric 8-bit weights ({described}) are not supported")
    if weights.get("actorder") == "group":  # a g_idx per projection: GPTQ's act-order groups
        raise ModelLoadError(
            f"{path}: 8-bit weights with actorder 'group' ({described}) are not supported"
        )
    if kind == "float" and strategy == "block":
        dynamic_groups = inputs.get("dynamic") and inputs.get("strategy") == "group"
        if list(weights.get("block_structure") or []) != [128, 128] or not (
            inputs.get("type") == "float" and dynamic_groups and inputs.get("group_size") == 128
        ):
            raise ModelLoadError(
                f"{path}: compressed-tensors block FP8 with {weights.get('block_structure')} "
                f"blocks and {_describe(inputs)} activations is not supported (kiln loads "
                "FP8_BLOCK: 128x128 blocks, dynamic activations per group of 128)"
            )
        return "fp8-block"
    if kind == "int" and inputs:
        per_token = inputs.get("dynamic") and inputs.get("strategy") == "token"
        if (
            strategy != "channel"
            or inputs.get("type") != "int"
            or not per_token
            or not (inputs.get("symmetric", True))
        ):
            raise ModelLoadError(
                f"{path}: compressed-tensors INT8 with {described} is not supported (kiln loads "
                "W8A8: int8 weights per channel, symmetric int8 activations per token)"
            )
        return "int8-w8a8"
    if inputs:
        return None  # FP8 W8A8 per channel / tensor: prequantized.py
    if strategy == "channel":
        return f"{'int8' if kind == 'int' else 'fp8'}-w8a16-channel"
    if strategy == "group" and weights.get("group_size"):
        return f"{'int8' if kind == 'int' else 'fp8'}-w8a16-g{int(weights['group_size'])}"
    raise ModelLoadError(
        f"{path}: compressed-tensors weight-only {described} is not supported (kiln loads 8-bit "
        "weights per channel or per group)"
    )


def eight_bit_tensors(
    weights: Iterator[tuple[str, torch.Tensor]], scheme: PrequantizedEightBit
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each projection's 8-bit ones in kiln's layout (the module
    docstring); every other tensor as it is."""
    scales_per_row = scheme.quantization == "int8-w8a8"  # [out, 1]: the loader's weight_scale
    routers: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        if "_proj." not in name:
            prefix, _, kind = name.rpartition(".")
            if prefix.endswith("gate") and kind in ("weight", "weight_scale", "weight_scale_inv"):
                got = routers.setdefault(prefix, {})
                got[kind] = tensor
                if kind == "weight" and tensor.dtype != torch.float8_e4m3fn:
                    yield name, routers.pop(prefix)["weight"]
                elif "weight" in got and len(got) == 2:  # a float8 router and its scales
                    yield f"{prefix}.weight", _widened_router(routers.pop(prefix), name)
                continue
            yield name, tensor
            continue
        prefix, kind = name.rsplit(".", 1)
        if kind == "weight_shape":  # the shape the packed codes imply already
            continue
        if kind == "weight_zero_point":  # older compressed-tensors wrote zeros for symmetric
            if bool(tensor.any()):
                raise ModelLoadError(f"{name}: nonzero zero points of a symmetric scheme")
            continue
        if kind == "weight_packed":
            yield f"{prefix}.weight", unpack_int8(tensor)
        elif kind in ("weight_scale", "weight_scale_inv") and not scales_per_row:
            yield f"{prefix}.weight_scales", tensor.float()
        else:
            yield name, tensor


def _widened_router(parts: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A float8 router (a checkpoint that quantized `mlp.gate` too) widened to fp32 with its
    scales, per 128x128 block, per channel or per tensor: kiln keeps routers unquantized."""
    weight = parts["weight"].float()
    scale = next(t for k, t in parts.items() if k != "weight").float()
    rows, k = weight.shape
    blocks = (-(-rows // 128), -(-k // 128))
    if scale.dim() == 2 and scale.shape[1] > 1 and tuple(scale.shape) == blocks:
        return weight * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[:rows, :k]
    if scale.numel() in (1, rows):
        return weight * scale.reshape(-1, 1)
    raise ModelLoadError(f"{name}: scales {tuple(scale.shape)} for a {rows}x{k} router")


def unpack_int8(packed: torch.Tensor) -> torch.Tensor:  # [rows, 4 * cols] int8
    """compressed-tensors' 8-bit `pack_to_int32` undone: code i of a row at bits 8 (i % 4) of
    word i // 4, stored + 128; a word's bytes in memory order are its codes in order (the
    little-endian hosts kiln runs on)."""
    unsigned = packed.contiguous().view(torch.uint8)
    return (unsigned ^ 0x80).view(torch.int8)


def _describe(q: dict[str, Any]) -> str:
    if not q:
        return "unquantized"
    dynamic = "dynamic" if q.get("dynamic") else "static"
    return f"{dynamic} {q.get('type')}{q.get('num_bits')}/{q.get('strategy')}"
