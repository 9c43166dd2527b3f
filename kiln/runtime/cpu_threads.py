"""How many CPU threads torch's intra-op pool gets when the config names none: the cores this
process may use (its affinity, its cgroup's CPU quota) less the ones other work keeps busy (the
1-minute load average). torch's own default, one per core, spins every thread at each op's
barrier: on a 2-core machine with other work running, two threads made batch-1 decode 4-10x
slower than one (issue 58: `kiln serve` 0.85-1.01 tok/s against 4.08-4.22, `kiln generate` 32-58
s against 15-20 s)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # what was counted, for the start-up log


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, capped by its cgroup's quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return max(1, min(cores, quota) if quota is not None else cores)


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup") -> int | None:
    """The CPU quota of this process's cgroup, rounded up to whole cores (None: unlimited or
    unknown): cgroup v2's cpu.max ("max 100000" or "200000 100000"), else v1's cfs files."""
    try:
        with open(os.path.join(root, "cpu.max"), encoding="utf-8") as f:
            quota, period = f.read().split()[:2]
        if quota == "max":
            return None
        return max(1, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    try:
        with open(os.path.join(root, "cpu", "cpu.cfs_quota_us"), encoding="utf-8") as f:
            quota_us = int(f.read())
        with open(os.path.join(root, "cpu", "cpu.cfs_period_us"), encoding="utf-8") as f:
            period_us = int(f.read())
    except (OSError, ValueError):
        return None
    return None if quota_us <= 0 else max(1, math.ceil(quota_us / period_us))


def choose_threads(cores: int | None = None, load: float | None = None) -> ThreadChoice:
    """The usable cores less the busy ones (rounded), at least one."""
    cores = usable_cores() if cores is None else cores
    if load is None:
        try:
            load = os.getloadavg()[0]
        except (AttributeError, OSError):
            load = 0.0
    threads = max(1, min(cores, cores - round(load)))
    return ThreadChoice(
        threads,
        f"{cores} usable core{'s' if cores != 1 else ''}, 1-minute load {load:.1f}; "
        "--threads N chooses",
    )
