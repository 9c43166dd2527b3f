"""Triton's interpreter (TRITON_INTERPRET=1, how the suite runs every kernel on the CPU) patches
triton.language's builtins again at every call of a @triton.jit helper inside a kernel, though
the kernel's launch already patched them for its whole grid: inspect.getmembers over the language
modules per helper call, a quarter of an interpreted attention kernel's time. `install()` makes a
helper's call inside a launch skip that repeat; the launch's own patch and its restore are
Triton's, unchanged, so what the kernels compute is the same."""

from __future__ import annotations

import threading
from typing import Any

_state = threading.local()


def install() -> bool:
    """Patch the interpreter once per process; False where its internals are not the ones known
    (another Triton version): the interpreter then runs as it is."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope is None:
        return False
    grid_call = executor.__call__
    if getattr(patch_lang, "_kiln_once", False):
        return True

    import triton.language as tl

    def langs(fn: Any) -> frozenset[str]:
        """Which of triton.language and its core module `fn` sees (what Triton patches)."""
        found = {v.__name__ for v in fn.__globals__.values() if v is tl or v is tl.core}
        return frozenset(found)

    def once_per_launch(fn: Any) -> Any:
        seen = langs(fn)
        if getattr(_state, "in_launch", False) and seen <= _state.patched:
            return scope()  # inside a launch that already patched these modules
        patched = patch_lang(fn)
        if getattr(_state, "in_launch", False):
            _state.patched = _state.patched | seen
        return patched

    def launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state.in_launch, _state.patched = True, frozenset()
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            _state.in_launch, _state.patched = False, frozenset()

    once_per_launch._kiln_once = True  # type: ignore[attr-defined]
    interpreter._patch_lang = once_per_launch
    interpreter.GridExecutor.__call__ = launch
    return True
