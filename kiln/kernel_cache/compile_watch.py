"""Which Triton kernels compile after start-up: each is a step every running request waits for.

Triton compiles a kernel once per *variant*: its constexprs, and for every other argument its
type plus whether an int equals 1 or divides by 16 and whether a pointer is 16-byte aligned. A
variant first needed mid-run stalls that step for the compile (0.2-2 s on an H200; a cached one
still loads from disk). The engine is meant to need none after start-up: its memory profile and
CUDA-graph capture run every kernel it uses, with arguments laid out as later steps lay them out.
This watch says when that fails (logged, and listed in `kiln bench` records) so the cause can be
fixed at its source.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass

logger = logging.getLogger("kiln")


@dataclass(frozen=True)
class KernelCompile:
    kernel: str  # module:function
    variant: str  # Triton's description: warps, stages, each argument's specialized type
    after_s: float  # seconds after the watch started


class CompileWatch:
    """Records every Triton kernel variant compiled (or loaded from Triton's disk cache) in this
    process after `start()`. Chains to whatever hook was installed before it."""

    def __init__(self) -> None:
        self.compiles: list[KernelCompile] = []
        self._started_at: float | None = None
        self._previous = None

    @property
    def active(self) -> bool:
        return self._started_at is not None

    def start(self) -> bool:
        """Install the hook (idempotent). False where Triton has no such hook (none installed)."""
        if self.active:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_cache_hook"):
            return False
        self._previous = runtime.jit_cache_hook
        runtime.jit_cache_hook = self
        self._started_at = time.perf_counter()
        return True

    def stop(self) -> None:
        if not self.active:
            return
        from triton import knobs

        if knobs.runtime.jit_cache_hook is self:
            knobs.runtime.jit_cache_hook = self._previous
        self._started_at, self._previous = None, None

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):
        # Triton calls this before compiling a variant it has not run in this process; a true
        # return would skip the compile, so only a chained hook may decide that.
        if self._started_at is not None and not is_manual_warmup:
            name = f"{getattr(fn, 'module', '?')}:{getattr(fn, 'name', '?')}"
            self.record(name, repr)
        if self._previous is None:
            return None
        return self._previous(
            key=key,
            repr=repr,
            fn=fn,
            compile=compile,
            is_manual_warmup=is_manual_warmup,
            already_compiled=already_compiled,
        )

    def record(self, kernel: str, variant: str) -> None:
        after = time.perf_counter() - (self._started_at or time.perf_counter())
        self.compiles.append(KernelCompile(kernel, variant, round(after, 3)))
        # Info, not a warning: sampling kernels still compile on an engine's first request.
        logger.info(
            "Triton kernel %s compiled %.1f s after start-up (the step waits for it): %s",
            kernel,
            after,
            variant,
        )

    def since(self, index: int) -> list[dict]:
        """The compiles after the first `index` (a count taken earlier), as plain dicts."""
        return [asdict(c) for c in self.compiles[index:]]


# One per process: Triton's hook is process-wide.
WATCH = CompileWatch()
