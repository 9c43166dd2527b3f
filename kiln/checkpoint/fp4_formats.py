"""FP4 checkpoints, dequantized exactly as they stream in: NVFP4 as llm-compressor writes it
(compressed-tensors `nvfp4-pack-quantized`: e2m1 codes two to a byte, an fp8 e4m3 scale per 16
inputs, an fp32 global scale per tensor, w = code * (scale / global_scale)) and as NVIDIA ModelOpt
exports it (hf_quant_config.json quant_algo NVFP4: w = code * scale * weight_scale_2), and MXFP4
(compressed-tensors `mxfp4-pack-quantized`: an e8m0 power-of-two scale per 32 inputs, w = code *
2^(scale - 127), the arithmetic of transformers' gpt-oss reader; and OpenAI's own layout of
gpt-oss's stacked experts, quant_method "mxfp4": openai_mxfp4_tensors).

kiln runs no FP4 arithmetic. Each projection's weight is dequantized to fp32 (the FP4 value each
code and scale stand for, computed as the producer's own dequantization computes it), then either
converted to float8 e4m3 with one scale per output channel (to_fp8: what loading an FP4
checkpoint runs, "fp8-dynamic") or handed on as fp32 (load_format "dequantized": the FP4 model
the FP8 one is checked against, and what `kiln build` quantizes when it rounds or smooths).

The FP8 scales are aligned to the FP4 grid rather than absmax / 448: an MXFP4 value is a 2-bit
significand times a power of two, so a power-of-two row scale keeps every one exactly (when a
row's group exponents span at most 14 binades); an NVFP4 value is an e2m1 code times an e4m3
group scale times the tensor's unit, so a row scale of the unit times 2^k or 1.5 * 2^k (the
better per row) keeps the most. On the NVFP4 test checkpoint the FP8 weights' error against the
exact FP4 values is 1.39% relative (2.57% with absmax scales, 1.91% with 128x128 absmax blocks,
1.46% with aligned ones); on the MXFP4 one, 0.

Loading with another quantization converts to it instead (CONVERSIONS): "fp8-block" (128x128
blocks with the same aligned scales: MXFP4 exact where a block's exponents fit e4m3, activations
per group of 128 inputs), "fp8-w8a16-channel" (to_fp8's codes, weight-only; MXFP4 only, where
they are exact) and "int8-w8a16-g16" (weight-only, exact for both: twice an e2m1 code is an
integer in [-12, 12], its scale half the FP4 group's). Schemes that cannot hold the FP4 values
(int8 per channel or per 128, W8A8 INT8) are refused by name.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError

logger = logging.getLogger("kiln")

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 128  # float8 block-scaled weights: 128 outputs x 128 inputs per scale

# The magnitudes of e2m1 codes 0..7 (code 8 + i: minus the same).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FORMATS = {"nvfp4-pack-quantized": ("nvfp4", 16), "mxfp4-pack-quantized": ("mxfp4", 32)}
# A projection's tensors, by producer: every one must arrive before its weight can be made.
_PARTS = {
    "compressed-tensors/nvfp4": ("weight_packed", "weight_scale", "weight_global_scale"),
    "compressed-tensors/mxfp4": ("weight_packed", "weight_scale"),
    "modelopt/nvfp4": ("weight", "weight_scale", "weight_scale_2"),
    "openai/mxfp4": ("blocks", "scales"),
}
_DROPPED = ("input_scale", "input_global_scale", "weight_shape")  # no FP4 activations in kiln
# What an FP4 checkpoint converts to as it loads, by EngineConfig.quantization: the per-channel
# float8 default, 128x128 float8 blocks, and weight-only 8-bit that keeps the values (by format).
DEFAULT_CONVERSION = "fp8-dynamic"
CONVERSIONS = {
    "nvfp4": ("fp8-dynamic", "fp8-block", "int8-w8a16-g16"),
    "mxfp4": ("fp8-dynamic", "fp8-block", "fp8-w8a16-channel", "int8-w8a16-g16"),
}


@dataclass(frozen=True)
class PrequantizedFp4:
    producer: str  # "compressed-tensors", "modelopt" or "openai" (gpt-oss's stacked experts)
    format: str  # "nvfp4" or "mxfp4"
    group_size: int  # inputs per scale: 16 (NVFP4) or 32 (MXFP4)

    @property
    def quantization(self) -> str:
        """The scheme loading it directly runs: float8 weights per output channel."""
        return "fp8-dynamic"

    @property
    def parts(self) -> tuple[str, ...]:
        return _PARTS[f"{self.producer}/{self.format}"]

    def conversion(self, requested: str) -> str:
        """The scheme loading this checkpoint with quantization `requested` runs: "none" and
        "fp8" mean the default (per-channel float8); one the FP4 values do not fit is refused."""
        if requested in ("none", "fp8", DEFAULT_CONVERSION):
            return DEFAULT_CONVERSION
        if self.producer == "openai":
            raise ModelLoadError(
                f"gpt-oss's MXFP4 experts load as {DEFAULT_CONVERSION} only, not "
                f"quantization={requested!r}"
            )
        if requested in CONVERSIONS[self.format]:
            return requested
        why = (
            "float8 codes per channel round NVFP4's e4m3 group scales (int8-w8a16-g16 keeps "
            "them exactly)"
            if requested == "fp8-w8a16-channel"
            else "its int8 scales per channel or per 128 inputs do not hold the FP4 groups' scales"
        )
        raise ModelLoadError(
            f"{self.producer} {self.format} checkpoint: it cannot load as "
            f"quantization={requested!r} ({why}); it converts to "
            f"{', '.join(CONVERSIONS[self.format])}, or runs exactly with "
            "load_format='dequantized'"
        )


def read_fp4(path: str, config: dict[str, Any]) -> PrequantizedFp4 | None:
    """The FP4 scheme a checkpoint declares (config.json or ModelOpt's hf_quant_config.json), or
    None for any other."""
    modelopt_file = os.path.join(path, "hf_quant_config.json")
    if os.path.isfile(modelopt_file):
        with open(modelopt_file, encoding="utf-8") as f:
            quant = json.load(f).get("quantization", {})
        if quant.get("quant_algo") != "NVFP4":
            return None
        if int(quant.get("group_size") or 16) != 16:
            raise ModelLoadError(f"{path}: ModelOpt NVFP4 with group_size {quant['group_size']}")
        if quant.get("kv_cache_quant_algo") not in (None, "FP8"):
            raise ModelLoadError(
                f"{path}: ModelOpt kv_cache_quant_algo {quant['kv_cache_quant_algo']!r} is not "
                "supported"
            )
        from kiln.checkpoint.prequantized import check_ignored

        check_ignored(path, quant.get("exclude_modules") or [], ["Linear"])
        return PrequantizedFp4("modelopt", "nvfp4", 16)
    declared = config.get("quantization_config") or {}
    if declared.get("quant_method") == "mxfp4":  # OpenAI's gpt-oss: the experts only
        return PrequantizedFp4("openai", "mxfp4", 32)
    if declared.get("quant_method") != "compressed-tensors":
        return None
    if declared.get("format") not in _FORMATS:
        return None
    fmt, group = _FORMATS[declared["format"]]
    groups = declared.get("config_groups") or {}
    (group_0,) = groups.values() if len(groups) == 1 else (None,)
    weights = (group_0 or {}).get("weights") or {}
    if (
        group_0 is None
        or weights.get("type") != "float"
        or weights.get("num_bits") != 4
        or int(weights.get("group_size") or 0) != group
        or not weights.get("symmetric", True)
    ):
        raise ModelLoadError(
            f"{path}: compressed-tensors {declared['format']} with {len(groups)} groups of "
            f"{weights.get('type')}{weights.get('num_bits')}/g{weights.get('group_size')} weights "
            f"is not supported (kiln reads one group of symmetric fp4 weights, group {group})"
        )
    from kiln.checkpoint.prequantized import check_ignored

    check_ignored(path, declared.get("ignore") or [], group_0.get("targets") or [])
    return PrequantizedFp4("compressed-tensors", fmt, group)


def fp4_tensors(
    weights: Iterator[tuple[str, torch.Tensor]], scheme: PrequantizedFp4, target: str | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each FP4 projection's as its `weight` (fp32 when `target`
    is None; else in that scheme, one of CONVERSIONS: convert), yielded once all of its parts
    have arrived (one projection's are held at a time in a file's order); every other tensor as
    it is. OpenAI's stacked experts: openai_mxfp4_tensors (per-channel float8 only)."""
    if scheme.producer == "openai":
        yield from openai_mxfp4_tensors(weights, target is not None)
        return
    # MXFP4 in float8 is exact unless a row's / block's exponents span more than e4m3's range:
    # the values that round are counted (NVFP4's float8 codes round by design, int8's never).
    count = scheme.format == "mxfp4" and target in ("fp8-dynamic", "fp8-block", "fp8-w8a16-channel")
    inexact = [0, 0]  # values the conversion rounds, values converted
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        if kind in _DROPPED and prefix.endswith("_proj"):
            continue
        # A ModelOpt projection's `weight` is its codes (uint8); an unquantized one's is not.
        if kind not in scheme.parts or (kind == "weight" and tensor.dtype != torch.uint8):
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[kind] = tensor
        if len(parts) == len(scheme.parts):
            del pending[prefix]
            exact = dequantize(scheme, parts, prefix)
            if target is None:
                yield f"{prefix}.weight", exact
                continue
            converted = convert(scheme, parts, exact, target)
            if count:
                inexact[0] += int((converted.values() != exact).sum())
                inexact[1] += exact.numel()
            yield f"{prefix}.weight", converted.codes
            yield f"{prefix}.{converted.scale_name}", converted.scales
    if inexact[0]:
        logger.warning(
            "%s %s -> %s: %d of %d weights rounded (%.2f%%)",
            scheme.producer, scheme.format, target, inexact[0], inexact[1],
            100.0 * inexact[0] / inexact[1],
        )  # fmt: skip
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = sorted(set(scheme.parts) - set(parts))
        raise ModelLoadError(f"FP4 checkpoint: {prefix} lacks {missing} ({len(pending)} such)")


def dequantize(
    scheme: PrequantizedFp4, parts: dict[str, torch.Tensor], prefix: str = "a projection"
) -> torch.Tensor:  # [out, in] fp32
    """One projection's weight from its FP4 parts, as its producer's own code computes it in
    fp32 (compressed-tensors' dequantize: code * (scale / global_scale); ModelOpt, as vLLM reads
    it: code * (scale * scale_2); MXFP4: ldexp(code, scale - 127), as transformers)."""
    packed = parts["weight" if scheme.producer == "modelopt" else "weight_packed"]  # [out, in/2]
    scale = parts["weight_scale"]
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    if packed.dtype != torch.uint8 or scale.shape != (rows, cols // scheme.group_size):
        raise ModelLoadError(
            f"FP4 checkpoint: {prefix} has {packed.dtype} codes {tuple(packed.shape)} and scales "
            f"{tuple(scale.shape)}; expected uint8 [out, in / 2] and [out, in / "
            f"{scheme.group_size}]"
        )
    codes = unpack_e2m1(packed)  # [out, in] fp32
    if scheme.format == "mxfp4":
        exponents = scale.to(torch.int32) - 127
        return torch.ldexp(codes, exponents.repeat_interleave(scheme.group_size, 1).float())
    scale32 = scale.float()
    if scheme.producer == "modelopt":
        scale32 = scale32 * parts["weight_scale_2"].float()
    else:
        scale32 = scale32 / parts["weight_global_scale"].float()
    return codes * scale32.repeat_interleave(scheme.group_size, 1)


@dataclass(frozen=True)
class Converted:
    """One projection's weight in a conversion's scheme, as its linear method loads it."""

    codes: torch.Tensor  # [out, in] float8 e4m3 or int8
    scales: torch.Tensor  # fp32: [out, 1], [ceil(out / 128), ceil(in / 128)] or [out, in / 16]
    scale_name: str  # the checkpoint name its method reads them by
    block: bool = False  # scales per 128x128 block

    def values(self) -> torch.Tensor:  # [out, in] fp32
        """The weight these codes and scales stand for."""
        scales = self.scales
        if self.block:
            scales = scales.repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
            scales = scales[: self.codes.shape[0], : self.codes.shape[1]]
        else:
            scales = scales.repeat_interleave(self.codes.shape[1] // scales.shape[1], 1)
        return self.codes.float() * scales


def convert(
    scheme: PrequantizedFp4, parts: dict[str, torch.Tensor], exact: torch.Tensor, target: str
) -> Converted:
    """One projection (its FP4 parts and their exact values) in scheme `target` (one of
    CONVERSIONS[scheme.format]): per-channel float8 (to_fp8, for "fp8-dynamic" and the
    weight-only "fp8-w8a16-channel"), 128x128 float8 blocks with FP4-aligned scales, or int8
    codes of twice the e2m1 value with half the group scale per 16 inputs (exact)."""
    if target in (DEFAULT_CONVERSION, "fp8-w8a16-channel"):
        codes, scale = _aligned_fp8(scheme, parts, exact)
        name = "weight_scale" if target == DEFAULT_CONVERSION else "weight_scales"
        return Converted(codes, scale, name)
    if target == "fp8-block":
        codes, scale = _aligned_fp8_blocks(scheme, parts, exact)
        return Converted(codes, scale, "weight_scales", block=True)
    assert target == "int8-w8a16-g16", target
    packed = parts["weight" if scheme.producer == "modelopt" else "weight_packed"]
    codes = (2 * unpack_e2m1(packed)).to(torch.int8)  # e2m1 values times 2: -12..12
    halves = group_scales(scheme, parts) / 2  # [out, in / group]: exact, powers of two apart
    return Converted(codes, halves.repeat_interleave(scheme.group_size // 16, 1), "weight_scales")


def group_scales(scheme: PrequantizedFp4, parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """[out, in / group_size] fp32: the value e2m1 code 1.0 stands for in each group (what
    dequantize multiplies the codes by)."""
    scale = parts["weight_scale"]
    if scheme.format == "mxfp4":
        return torch.ldexp(torch.ones(scale.shape), scale.to(torch.int32).float() - 127)
    if scheme.producer == "modelopt":
        return scale.float() * parts["weight_scale_2"].float()
    return scale.float() / parts["weight_global_scale"].float()


def _aligned_fp8_blocks(
    scheme: PrequantizedFp4, parts: dict[str, torch.Tensor], weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8, [ceil(out/128), ceil(in/128)])
    """_aligned_fp8 per 128x128 block (the last ones partial): each block's scale the unit
    times 2^k (NVFP4: or 1.5 * 2^k, the better per block), k the smallest that fits its absmax."""
    rows, k = weight.shape
    rb, kb = -(-rows // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = torch.nn.functional.pad(weight, (0, kb * FP8_BLOCK - k, 0, rb * FP8_BLOCK - rows))
    # [rb * kb, 128 * 128]: each block's values in one row, so the per-row search applies.
    blocks = padded.view(rb, FP8_BLOCK, kb, FP8_BLOCK).permute(0, 2, 1, 3).reshape(rb * kb, -1)
    codes, scale = _aligned_fp8(scheme, parts, blocks)
    codes = codes.view(rb, kb, FP8_BLOCK, FP8_BLOCK).permute(0, 2, 1, 3)
    codes = codes.reshape(rb * FP8_BLOCK, kb * FP8_BLOCK)[:rows, :k].contiguous()
    return codes, scale.view(rb, kb)


def to_fp8(
    scheme: PrequantizedFp4, parts: dict[str, torch.Tensor], prefix: str = "a projection"
) -> tuple[torch.Tensor, torch.Tensor]:  # ([out, in] float8 e4m3, [out, 1] fp32)
    """One projection's FP4 weight as float8 codes times a scale per output channel, the scale
    aligned to the FP4 grid (the module docstring): the row's unit times 2^k (and, for NVFP4,
    times 1.5 * 2^k), k the smallest that keeps the row's absmax within e4m3's 448; of the
    candidates, each row keeps the one with the least squared error."""
    return _aligned_fp8(scheme, parts, dequantize(scheme, parts, prefix))


def _aligned_fp8(
    scheme: PrequantizedFp4,
    parts: dict[str, torch.Tensor],
    weight: torch.Tensor,  # [out, in] fp32: the parts dequantized
) -> tuple[torch.Tensor, torch.Tensor]:
    multiples: tuple[float, ...] = (1.0, 1.5)
    if scheme.format == "mxfp4":
        unit, multiples = torch.tensor(1.0), (1.0,)
    elif scheme.producer == "modelopt":
        unit = parts["weight_scale_2"].float().reshape(())
    else:
        unit = 1.0 / parts["weight_global_scale"].float().reshape(())
    absmax = weight.abs().amax(dim=1, keepdim=True)
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for multiple in multiples:
        step = unit * multiple
        scale = step * torch.exp2(torch.ceil(torch.log2(absmax / (FP8_E4M3_MAX * step))))
        scale = torch.where(absmax > 0, scale, torch.ones_like(scale))
        codes = (weight / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        error = (codes.float() * scale - weight).square().sum(dim=1, keepdim=True)
        if best is None:
            best = (codes, scale, error)
            continue
        better = error < best[2]
        best = (
            torch.where(better, codes.float(), best[0].float()).to(torch.float8_e4m3fn),
            torch.where(better, scale, best[1]),
            torch.minimum(error, best[2]),
        )
    assert best is not None
    return best[0], best[1].float()


def openai_mxfp4_tensors(
    weights: Iterator[tuple[str, torch.Tensor]], fp8: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """gpt-oss's MXFP4 experts as OpenAI ships them: `<name>_blocks` uint8 [E, out, in / 32,
    16] (two e2m1 codes a byte, the low nibble first) and `<name>_scales` uint8 [E, out, in /
    32] (e8m0 exponents), yielded as `<name>` in the layout of transformers' dequantized
    parameter, [E, in, out]: fp32 values exactly as transformers' convert_moe_packed_tensors
    computes them, or (`fp8`) float8 e4m3 with `<name>_scale` [E, out] fp32 per output channel
    (to_fp8's power-of-two scales: exact). One expert is converted at a time."""
    scheme = PrequantizedFp4("openai", "mxfp4", 32)
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        prefix, _, kind = name.rpartition("_")
        if kind not in scheme.parts or tensor.dtype != torch.uint8:
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[kind] = tensor
        if len(parts) < len(scheme.parts):
            continue
        del pending[prefix]
        blocks, scales = parts["blocks"], parts["scales"]
        if blocks.dim() != 4 or blocks.shape[:3] != scales.shape or blocks.shape[3] != 16:
            raise ModelLoadError(
                f"MXFP4 checkpoint: {prefix} has blocks {tuple(blocks.shape)} and scales "
                f"{tuple(scales.shape)}; expected [E, out, in / 32, 16] and [E, out, in / 32]"
            )
        codes, channel_scales, inexact = [], [], 0
        for expert in range(blocks.shape[0]):
            expert_parts = {
                "weight_packed": blocks[expert].reshape(blocks.shape[1], -1),
                "weight_scale": scales[expert],
            }
            exact = dequantize(scheme, expert_parts, prefix)
            if fp8:
                code, scale = _aligned_fp8(scheme, expert_parts, exact)
                inexact += int((code.float() * scale != exact).sum())
                codes.append(code)
                channel_scales.append(scale[:, 0])
            else:
                codes.append(exact)
        if inexact:  # a row whose groups' exponents span more than e4m3's 15 binades
            logger.warning(
                "%s: %d of %d MXFP4 values round in float8 (per-channel scales)",
                prefix,
                inexact,
                blocks.numel() * 2,
            )
        yield prefix, torch.stack(codes).transpose(1, 2)
        if fp8:
            yield f"{prefix}_scale", torch.stack(channel_scales)
    if pending:
        prefix, parts = next(iter(pending.items()))
        missing = sorted(set(scheme.parts) - set(parts))
        raise ModelLoadError(f"MXFP4 checkpoint: {prefix} lacks {missing} ({len(pending)} such)")


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:  # [rows, 2 * cols] fp32
    """uint8 [rows, cols] -> the e2m1 values, element 2j of a row from byte j's low nibble."""
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=packed.device)
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
    return lut[nibbles.long()]
