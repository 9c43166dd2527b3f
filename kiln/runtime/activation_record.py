"""The memory plan's activation peak, recorded in an engine directory at build time and reused at
load when nothing it depends on differs.

On CUDA the plan runs a profiled dummy step at the largest shape the scheduler can form
(kiln.runtime.memory_plan.profile_activation_peak): 1.0 s of a 10 s first token from an 8B FP8
engine on the H200 with its kernels already compiled (benchmarks/results/
2026-12-02-h200-splits-json-spec-prequant-tput/run1). `kiln build` on a GPU runs the new engine
once (kiln.builder.warm); that run's profile is kept in the manifest with the key below, and a
later load whose key is exactly equal takes the recorded numbers instead of running the step
again. Any difference (another GPU, torch, Triton or CUDA, another kiln source tree, another
max_num_batched_tokens / max_num_seqs / max_model_len / block size / dtype / KV dtype /
quantization / kernels, another rank layout or allocator setting) profiles as before, so the KV
budget is the one the same profile would give.

Besides the peak, the record holds how much device memory outside PyTorch's allocator the
profile step itself added (the kernels' modules it loaded, library handles): a load that skips the
step has not loaded them yet when it measures free memory, and adds the recorded amount instead.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import lru_cache
from importlib import metadata
from typing import Any

logger = logging.getLogger("kiln")

# Bumped when what the profile measures changes meaning (a record of another version never matches).
RECORD_VERSION = 1


@dataclass(frozen=True)
class ActivationProfile:
    """One profile of the largest step: its peaks above the weights (bytes), the device memory
    outside torch it added, and the key it was measured under."""

    key: dict[str, Any]
    peak_bytes: int  # the whole step (forward, logits, sampler)
    forward_peak_bytes: int  # the forward alone (sizes the decode graphs' pool)
    non_torch_growth_bytes: int  # outside PyTorch's allocator, added by running the step
    source: str = "profiled"  # "profiled" (measured in this process) or "recorded" (the build's)

    def as_record(self) -> dict[str, Any]:
        """The manifest's `activation_profile` entry."""
        record = asdict(self)
        del record["source"]
        return record


def kiln_source_digest() -> str:
    """blake2b over every kiln/*.py file (path and bytes): any code change is another key, so a
    forward whose temporaries changed is profiled again. ~16 ms on the CPU host."""
    return _source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@lru_cache(maxsize=4)
def _source_digest(root: str) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for folder, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


def software_key() -> dict[str, Any]:
    """The GPU and the software under the profile (torch's kernels and allocator, Triton's)."""
    import torch

    try:
        triton_version = metadata.version("triton")
    except metadata.PackageNotFoundError:
        triton_version = None
    key: dict[str, Any] = {
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": triton_version,
        "kiln_source": kiln_source_digest(),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
    }
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        key["gpu_class"] = torch.cuda.get_device_name()
        key["compute_capability"] = f"{major}.{minor}"
    return key


def profile_key(
    engine_id: str,
    shapes: dict[str, Any],
    software: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Everything the profiled step depends on: the engine (its id covers the weights,
    architecture, quantization and scales), the step's shapes and settings (`shapes`: the
    resolved config the profile reads) and the software (`software`; default software_key())."""
    return {
        "record_version": RECORD_VERSION,
        "engine_id": engine_id,
        **shapes,
        **(software_key() if software is None else software),
    }


def resolve_activation_profile(
    key: dict[str, Any] | None,
    recorded: dict[str, Any] | None,
    measure: Callable[[], tuple[int, int, int]],
) -> ActivationProfile:
    """The recorded profile when its key equals `key` exactly, else `measure()` ((peak,
    forward peak, outside-torch growth) in bytes, run now). `key` None (not an engine
    directory): always measured."""
    if key is not None and recorded is not None:
        differs = _differences(key, recorded.get("key"))
        if not differs:
            try:
                profile = ActivationProfile(
                    key,
                    int(recorded["peak_bytes"]),
                    int(recorded["forward_peak_bytes"]),
                    int(recorded["non_torch_growth_bytes"]),
                    source="recorded",
                )
            except (KeyError, TypeError, ValueError):
                logger.info("memory plan: the engine's recorded activation peak is unreadable")
            else:
                logger.info(
                    "memory plan: activation peak recorded at build (%.2f GiB), key matches: "
                    "no profile step",
                    profile.peak_bytes / (1 << 30),
                )
                return profile
        else:
            logger.info(
                "memory plan: the engine's recorded activation peak was measured under another "
                "%s: profiling",
                ", ".join(differs),
            )
    peak, forward_peak, growth = measure()
    return ActivationProfile(key or {}, peak, forward_peak, growth, source="profiled")


def _differences(key: dict[str, Any], recorded: object) -> list[str]:
    if not isinstance(recorded, dict):
        return ["key (none recorded)"]
    names = sorted(set(key) | set(recorded))
    return [n for n in names if key.get(n) != recorded.get(n) or (n in key) != (n in recorded)]
