"""Programmatic dependent launch inside a kernel (see _device.use_pdl)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_for_previous_kernel(USE_PDL: tl.constexpr):
    """Called first in a kernel: waits until the kernel before it has finished and its writes
    are visible, then lets the next kernel start launching while this one runs. Every kernel
    launched with PDL must call it before reading anything an earlier kernel wrote (and before
    writing anything one may still read); transitively, finishing implies every earlier kernel
    finished too."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
