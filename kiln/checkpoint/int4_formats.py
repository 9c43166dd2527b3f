"""INT4 weight-only (W4A16) checkpoints users already have, read into kiln's one INT4 layout
(kiln.layers.quantization.int4): GPTQ (AutoGPTQ / GPTQModel, `quant_method` "gptq"), AutoAWQ's
GEMM format ("awq", version "gemm") and llm-compressor's compressed-tensors `pack-quantized`.

Each checkpoint tensor converts on its own as it streams past (int4_tensors), so loading holds
one tensor at a time: a projection's `weight` becomes its codes [out, in / 8] int32 (code 8j + i
of a row at bits 4i of word j), `weight_scales` and `weight_zeros` [out, groups] fp32 (zeros in
code units: w = (code - zero) * scale), `weight_g_idx` [in] the group of each input (GPTQ's
act-order; the layer reorders its inputs after loading).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from kiln.errors import ModelLoadError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the column at bits 4i of an AutoAWQ GEMM word
_PROJ_SUFFIXES = ("_proj.qweight", "_proj.qzeros", "_proj.scales", "_proj.g_idx",
                  "_proj.weight_packed", "_proj.weight_scale", "_proj.weight_zero_point",
                  "_proj.weight_g_idx", "_proj.weight_shape")  # fmt: skip
_PROJ_SUFFIXES_BARE = tuple(suffix.removeprefix("_proj") for suffix in _PROJ_SUFFIXES)
# Mixtral's experts name their projections w1 / w2 / w3 (no "_proj").
_MIXTRAL_EXPERT_RE = re.compile(r"\.experts\.\d+\.w[123]\.[a-z_]+$")


@dataclass(frozen=True)
class PrequantizedInt4:
    producer: str  # "gptq", "awq" or "compressed-tensors"
    group_size: int  # inputs per scale; 0: one scale per output channel
    zero_offset: int  # added to a stored zero point (GPTQ's v1 format stores zero - 1)
    has_zeros: bool  # whether the checkpoint holds zero points (else 8: symmetric)

    @property
    def quantization(self) -> str:
        """kiln's scheme name (linear_method_factory): "int4-g128", "int4-channel-sym", ...
        ("-sym": no zero points in the checkpoint, 8 for every group)."""
        groups = f"g{self.group_size}" if self.group_size else "channel"
        return f"int4-{groups}" + ("" if self.has_zeros else "-sym")


def read_int4(path: str, config: dict[str, Any]) -> PrequantizedInt4 | None:
    """The INT4 scheme an HF checkpoint's config.json declares, or None for any other."""
    declared = config.get("quantization_config") or {}
    method = declared.get("quant_method")
    if method in ("gptq", "awq"):
        bits, group = declared.get("bits"), int(declared.get("group_size", -1))
        if bits != 4:
            raise ModelLoadError(f"{path}: {method} with {bits}-bit weights (kiln loads 4-bit)")
        if method == "gptq":
            fmt = declared.get("checkpoint_format") or "gptq"
            if fmt not in ("gptq", "gptq_v2") or declared.get("lm_head"):
                raise ModelLoadError(
                    f"{path}: GPTQ checkpoint_format {fmt!r} (lm_head quantized: "
                    f"{bool(declared.get('lm_head'))}) is not supported (kiln loads 'gptq' and "
                    "'gptq_v2' with the LM head unquantized)"
                )
            return PrequantizedInt4("gptq", max(group, 0), 1 if fmt == "gptq" else 0, True)
        version = str(declared.get("version", "gemm")).lower()
        if version != "gemm" or not declared.get("zero_point", True):
            raise ModelLoadError(
                f"{path}: AWQ version {version!r} (zero_point {declared.get('zero_point')}) is "
                "not supported (kiln loads AutoAWQ's GEMM format with zero points)"
            )
        if declared.get("modules_to_not_convert"):
            raise ModelLoadError(f"{path}: AWQ modules_to_not_convert is not supported")
        return PrequantizedInt4("awq", max(group, 0), 0, True)
    if method != "compressed-tensors" or declared.get("format") != "pack-quantized":
        return None
    groups = declared.get("config_groups") or {}
    (group_0,) = groups.values() if len(groups) == 1 else (None,)
    weights = (group_0 or {}).get("weights") or {}
    if (
        group_0 is None
        or group_0.get("input_activations")
        or weights.get("type") != "int"
        or weights.get("num_bits") != 4
        or weights.get("strategy") not in ("group", "channel")
    ):
        raise ModelLoadError(
            f"{path}: compressed-tensors pack-quantized with {len(groups)} groups of "
            f"{weights.get('type')}{weights.get('num_bits')}/{weights.get('strategy')} weights "
            "is not supported (kiln loads one group of int4 weights per group or channel, "
            "activations unquantized)"
        )
    from kiln.checkpoint.prequantized import check_ignored

    check_ignored(path, declared.get("ignore") or [], group_0.get("targets") or [])
    group = int(weights.get("group_size") or 0) if weights["strategy"] == "group" else 0
    return PrequantizedInt4("compressed-tensors", group, 0, not weights.get("symmetric", True))


def int4_tensors(
    weights: Iterator[tuple[str, torch.Tensor]], scheme: PrequantizedInt4
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with each projection's INT4 ones in kiln's layout (the module
    docstring); every other tensor as it is."""
    for name, tensor in weights:
        if not name.endswith(_PROJ_SUFFIXES) and not (
            _MIXTRAL_EXPERT_RE.search(name) and name.endswith(_PROJ_SUFFIXES_BARE)
        ):
            yield name, tensor
            continue
        prefix, kind = name.rsplit(".", 1)
        converted = _convert(scheme, kind, tensor)
        if converted is not None:
            yield f"{prefix}.{converted[0]}", converted[1]


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:  # [rows, 8 * cols] int32 in 0..15
    """[rows, cols] int32 words -> codes, code 8j + i of a row from bits 4i of word j (the
    kernels' reference.unpack_int4; the checkpoint layer imports no kernels)."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:  # [rows, cols / 8] int32
    """unpack_int4's inverse (the bits do not overlap, so their sum is their OR)."""
    c = codes.to(torch.int32).reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=codes.device)
    return (c << shifts).sum(-1, dtype=torch.int32)


def _convert(
    scheme: PrequantizedInt4, kind: str, t: torch.Tensor
) -> tuple[str, torch.Tensor] | None:
    """One checkpoint tensor of a projection -> (kiln's suffix, tensor), or None: not needed."""
    if kind in ("g_idx", "weight_g_idx"):
        return "weight_g_idx", t.to(torch.int32)
    if kind == "weight_shape":  # the shape the packed codes imply already
        return None
    if kind in ("scales", "weight_scale"):
        scales = t.t() if scheme.producer != "compressed-tensors" else t
        return "weight_scales", scales.float().contiguous()
    if kind == "weight_packed":  # [out, in / 8], codes stored + 8: kiln's layout as it is
        return "weight", t.contiguous()
    if kind == "weight_zero_point":  # [out / 8, groups] packed along the outputs, + 8
        return "weight_zeros", unpack_int4(t.t().contiguous()).t().float().contiguous()
    if scheme.producer == "gptq":
        if kind == "qweight":  # [in / 8, out] packed along the inputs: kiln's words, transposed
            return "weight", t.t().contiguous()
        zeros = unpack_int4(t).t().float() + scheme.zero_offset  # [groups, out / 8]
        return "weight_zeros", zeros.contiguous()
    inverse = [AWQ_ORDER.index(c) for c in range(8)]  # AutoAWQ GEMM: [in, out / 8] interleaved
    unpacked = unpack_int4(t).reshape(t.shape[0], -1, 8)[:, :, inverse].flatten(1)
    if kind == "qweight":
        return "weight", pack_int4(unpacked.t().contiguous())
    return "weight_zeros", unpacked.t().float().contiguous()
