"""Bench results: environment facts, a readable table, and the JSON record."""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import pathlib
import platform
import subprocess
import sys
import time
from collections.abc import Sequence

import torch

import kiln
from kiln.config import EngineConfig
from kiln.envs import changed, envs


def kiln_revision() -> str:
    """kiln's own git revision (of the checkout kiln is imported from, not the current
    directory's), "-dirty" if its tracked files changed; KILN_GIT_REVISION overrides it for trees
    copied without their .git."""
    revision = envs().git_revision
    if revision:
        return revision
    here = pathlib.Path(kiln.__file__).resolve().parent

    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=here)
        return out.stdout.strip()

    try:
        rev = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", ".")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (rev or "unknown") + ("-dirty" if rev and dirty else "")


def kiln_source_hash() -> str:
    """A hash of kiln's Python sources as imported: names the code that ran even where the
    revision cannot (a copied tree, uncommitted changes)."""
    root = pathlib.Path(kiln.__file__).resolve().parent
    digest = hashlib.blake2b(digest_size=8)
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def engine_config_record(config: EngineConfig) -> dict:
    """The config's fields that are set, as JSON values (an oracle's SpeculativeConfig as its
    fields)."""
    return {
        k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) and not isinstance(v, type) else v
        for k, v in vars(config).items()
        if v is not None
    }


def environment(device: torch.device) -> dict:
    import transformers

    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = (
            f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
        )
    env = {
        "command": " ".join(sys.argv),
        "kiln_version": kiln.__version__,
        "git_revision": kiln_revision(),
        "kiln_source_hash": kiln_source_hash(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": hardware,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        # The KILN_* variables this run set away from their defaults.
        "kiln_env": changed(envs()),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def measure_copy_bandwidth(device: torch.device, num_bytes: int = 1 << 30) -> float:
    """Bytes read + written per second by a large device copy: the memory roofline we quote."""
    if device.type == "cpu":
        num_bytes = 1 << 28
    src = torch.empty(num_bytes // 2, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(2):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize()
    reps = 10 if device.type == "cuda" else 3
    t0 = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return 2 * src.numel() * src.element_size() * reps / elapsed


def format_table(rows: Sequence[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for j, row in enumerate(rows):
        lines.append("  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)))
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str, record: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2)
        f.write("\n")
