"""Bench results: environment facts, a readable table, and the JSON record."""

from __future__ import annotations

import datetime
import json
import platform
import subprocess
import sys
import time

import torch

from kiln.envs import envs


def environment(device: torch.device) -> dict:
    import transformers

    # KILN_GIT_REVISION: for machines the code reaches without its .git (a copied tree).
    rev, dirty = envs().git_revision or "", ""
    if not rev:
        try:
            rev = subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
            dirty = subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"],
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    rev = rev or "unknown"
    if device.type == "cuda":
        hardware = torch.cuda.get_device_name(device)
    else:
        hardware = (
            f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads"
        )
    env = {
        "command": " ".join(sys.argv),
        "git_revision": rev + ("-dirty" if dirty else ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": hardware,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
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


def format_table(rows: list[tuple[str, str, str, str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
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
