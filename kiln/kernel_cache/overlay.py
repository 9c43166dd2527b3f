"""Triton's cache manager with this process's installed engine kernels in front of it.

Triton finds a compiled kernel by its group file (`get_group`); everything else it caches (the
launchers and `cuda_utils` it builds from C, every kernel compiled here) goes through the user's
own cache as usual. Only the lookup of a kernel group consults the private folder the engine's
verified device code was installed into (triton_cache.install), so a host-side module can never
come from an engine directory.
"""

from __future__ import annotations

import json
import os
from typing import ClassVar

from triton.runtime.cache import FileCacheManager


class EngineKernelCache(FileCacheManager):
    overlay_dir: ClassVar[str | None] = None

    def __init__(self, key: str, override: bool = False, dump: bool = False) -> None:
        super().__init__(key, override=override, dump=dump)
        private = self.overlay_dir
        self._private = None if override or dump or private is None else os.path.join(private, key)

    def get_group(self, filename: str) -> dict[str, str] | None:
        if self._private is not None:
            group = _private_group(os.path.join(self._private, f"__grp__{filename}"))
            if group is not None:
                return group
        return super().get_group(filename)


def _private_group(path: str) -> dict[str, str] | None:
    try:
        with open(path, encoding="utf-8") as f:
            children = json.load(f)["child_paths"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(children, dict) or not all(os.path.isfile(p) for p in children.values()):
        return None
    return dict(children)
