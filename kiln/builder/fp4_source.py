"""`kiln build` from an FP4 checkpoint (NVFP4, MXFP4: kiln.checkpoint.fp4_formats): an
unquantized source whose weights are the FP4 values dequantized exactly. Its perplexity (the
accuracy check's baseline) is the exact FP4 model's, run in the model dtype (load_format
"dequantized"); the engine's weights are those values in the build's scheme, "fp8-dynamic"
unless asked otherwise. A plain build to a scheme the checkpoint converts to (fp8, fp8-block,
int8-w8a16-g16, ...: fp4_formats.CONVERSIONS) takes the FP4-aligned conversion loading does (the
same bytes as loading the checkpoint directly with that quantization); any other build (other
schemes, rounding, smoothing, layers kept unquantized) quantizes the exact fp32 values as it
would any source's."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kiln.checkpoint.fp4_formats import CONVERSIONS, PrequantizedFp4, read_fp4

if TYPE_CHECKING:
    from kiln.builder.options import BuildOptions

_PRODUCERS = {"compressed-tensors": "llm-compressor", "modelopt": "NVIDIA ModelOpt"}


def inspect_fp4(path: str) -> PrequantizedFp4 | None:
    """The FP4 scheme of an HF checkpoint directory, None for any other source."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        return None
    from kiln.checkpoint.safetensors_loader import read_hf_config

    return read_fp4(path, read_hf_config(path))


def resolve_quantization(requested: str, fp4: PrequantizedFp4 | None) -> str:
    """ "auto" for an FP4 source: what loading it runs (FP8 per output channel)."""
    return fp4.quantization if fp4 is not None and requested == "auto" else requested


def weights_format(fp4: PrequantizedFp4 | None, options: BuildOptions) -> str:
    """How the engine's weights read the source: its conversion ("auto": loading's, to
    `options.quantization`, PrequantizedFp4.conversion) when the build asks for a scheme the
    checkpoint converts to and changes nothing else, else the exact values ("dequantized")."""
    if fp4 is None:
        return "auto"
    plain = (
        options.quantization in ("fp8", *CONVERSIONS[fp4.format])
        and options.weight_rounding == "nearest"
        and options.smoothing == "none"
        and options.outlier_columns == 0
        and not options.unquantized_layers
    )
    return "auto" if plain else "dequantized"


def source_format(fp4: PrequantizedFp4 | None) -> str:
    """How the build's source pass (perplexity, calibration) loads: the exact FP4 model."""
    return "auto" if fp4 is None else "dequantized"


def quantization_source(fp4: PrequantizedFp4, weights: str) -> dict[str, Any]:
    """The manifest's record of where the engine's weights came from."""
    how = (
        "converted as loading converts it, scales aligned to the FP4 grid "
        "(kiln.checkpoint.fp4_formats)"
        if weights == "auto"
        else "the exact fp32 values, quantized as the build's options say"
    )
    return {
        "method": f"FP4 checkpoint dequantized exactly, then {how}",
        "format": f"{fp4.producer} {fp4.format}",
        "producer": _PRODUCERS.get(fp4.producer, fp4.producer),
        "group_size": fp4.group_size,
        "accuracy_baseline": "the FP4 model dequantized exactly, in the model dtype",
    }
