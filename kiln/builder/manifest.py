"""EngineManifest: what an engine directory holds and how it was made (`kiln_engine.json`).

The reader (kiln.checkpoint.engine_dir) owns the file name and the format version and checks a
loaded directory against `files`; everything else is a record for people and for the cache.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kiln.checkpoint.engine_dir import ENGINE_FORMAT_VERSION, MANIFEST_FILE


@dataclass(frozen=True)
class EngineManifest:
    engine_id: str
    """blake2b of the source's content hash, the build options and the kiln version."""
    kiln_version: str
    source: str
    """The name of the file or directory the engine was built from (informational, and no
    path of the build machine's; `source_hash` identifies it)."""
    source_hash: str
    """blake2b over the source's files (config, weights, tokenizer; or the GGUF file)."""
    architecture: dict[str, Any]
    """The ModelConfig as an HF config.json dict."""
    dtype: str
    """Element type of the unquantized weights ("float32", "bfloat16", ...)."""
    kv_cache_dtype: str
    max_model_len: int | None
    quantization: str
    """"none", "fp8" (static calibrated input scales), "fp8-dynamic" or "int4-g<group>" (an
    INT4 build's: kiln.builder.int4)."""
    scales_method: str | None
    """How the activation scales were chosen; None when unquantized."""
    calibration_data_hash: str | None
    input_scales: dict[str, float] | None
    """Static "fp8": each projection's calibrated input scale (also a tensor in the weights),
    which loading needs to make the projection's method."""
    accuracy: dict[str, Any]
    """The accuracy check's report: source and engine perplexities, or why it was skipped."""
    gpu_class: str | None
    """The CUDA device the engine was built on (None on the CPU); loading elsewhere fails."""
    kernel_tiles: dict[str, Any] | None
    """The kernel tile choices the engine runs with on `gpu_class` (kiln.builder.tiles: the
    small-batch linear kernels' at the model's shapes, decode attention's); None without a GPU
    (`kernel_tiles_reason` says why)."""
    build_seconds: float
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    """{file name: {"size": bytes, "blake2b": hex}} of every file but this one."""
    format_version: int = ENGINE_FORMAT_VERSION
    tensor_parallel_size: int = 1
    """> 1: the weights are one shard per tensor rank (rank-R/...), loadable at this size only."""
    kv_scales: list[list[float]] | None = None
    """`--kv-cache-dtype fp8`: each layer's calibrated [k_scale, v_scale] (powers of two), already
    folded into the weights (kiln.models.kv_scales); loading folds them into the softmax
    scales."""
    kv_head_scales: list[list[list[float]]] | None = None
    """`--kv-cache-dtype int8`: each layer's [[k scale per KV head], [v scale per KV head]]
    (powers of two, the whole model's heads), measured over the calibration text and folded
    into the weights (kiln.models.kv_scales.fold_kv_head_scales); loading folds the softmax's
    share. Any engine takes an int8 cache; one without these measures them as it loads."""
    lm_head_quantization: str = "none"
    """"fp8": the LM head's weights are float8 with per-row scales (`--lm-head-quantization`),
    and the engine loads with that head; "none": the model dtype."""
    kv_scales_in_weights: bool = True
    """Whether `kv_scales` are folded into the weights already (every calibrated set is). False:
    a pre-quantized checkpoint's k_scale / v_scale carried for a float8 cache, which loading
    folds in only when the cache is float8, as it does loading the checkpoint itself."""
    quantization_source: dict[str, Any] | None = None
    """A build from a pre-quantized checkpoint (kiln.builder.prequantized): the method, the
    checkpoint's format and producer, the quantization config it declares, where the KV scales
    came from. None: kiln quantized the engine itself (or it is unquantized)."""
    kernel_tiles_reason: str | None = None
    """Why `kernel_tiles` is None."""
    unquantized_layers: list[str] | None = None
    """Decoder projections kept in the model dtype in a quantized engine (`--unquantized-layers`);
    loading makes them unquantized. None: every projection is quantized."""
    smoothing: str = "none"
    """"smoothquant:<alpha>": the FP8 projections' inputs were smoothed per channel on the
    calibration text (kiln.builder.calibrate.smoothing), the factors folded into the weights."""

    outlier_channels: dict[str, list[int]] | None = None
    """`--outlier-columns`: each FP8 projection's input channels carried as a second float8
    term (kiln.layers.quantization.outlier_columns; its weight holds their columns twice), which
    loading needs to make the projection's method. None: no outlier columns."""

    lora_adapter: dict[str, Any] | None = None
    """`--lora`: the PEFT adapter merged into the weights (its directory's name, the blake2b of
    its files, rank, alpha); None: none."""

    built_at: str | None = None
    """When the build finished (UTC, ISO 8601)."""
    kiln_commit: str | None = None
    """The git revision of the kiln that built it ("-dirty" with uncommitted changes), or None
    where kiln is not a git checkout."""

    def write(self, directory: str) -> None:
        with open(os.path.join(directory, MANIFEST_FILE), "w", encoding="utf-8") as f:
            json.dump(asdict(self), f, indent=2, sort_keys=True)
            f.write("\n")

    @classmethod
    def read(cls, directory: str) -> EngineManifest:
        with open(os.path.join(directory, MANIFEST_FILE), encoding="utf-8") as f:
            return cls(**json.load(f))


def stamped(manifest: EngineManifest, build_seconds: float) -> EngineManifest:
    """`manifest` with its build time, when it finished (UTC) and the kiln that built it."""
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return replace(manifest, build_seconds=build_seconds, built_at=now, kiln_commit=_kiln_commit())


def _kiln_commit() -> str | None:
    """The revision of the checkout this kiln is imported from, not the current directory's."""
    here = os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=here)
        return out.stdout.strip() if out.returncode == 0 else ""

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = rev and git("status", "--porcelain", "--untracked-files=no", ".")
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + ("-dirty" if dirty else "")) or None
