"""Client SDKs imported on their first use rather than while pytest collects: anthropic's (3,500
modules, 150k objects the cyclic GC tracks) and openai's (700 modules, 65k objects) would
otherwise sit in the heap from the start, a fifth of it, and every engine start in the session
walks the whole heap (kiln collects before it freezes its startup objects)."""

from __future__ import annotations

import importlib
from typing import Any


class lazy_import:
    """Reads attributes from the module `name`, importing it on the first read. Private names are
    not forwarded: pytest's collection probes every module global for `__test__`,
    `_fixture_function_marker` and the like, which must not import it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("_"):
            raise AttributeError(attr)
        return getattr(importlib.import_module(self._name), attr)
