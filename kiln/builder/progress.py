"""Progress bars for `kiln build`'s long steps: loading a model to measure or calibrate, the
held-out perplexities, calibration passes and layer-by-layer rounding. Some are one engine call
that reports nothing until it returns (a prefill of a few thousand tokens on the CPU takes
seconds), so on a terminal each bar is also redrawn on a timer: its elapsed time moves while
the step runs."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

# How often a bar is redrawn while nothing updates it.
_REDRAW_S = 0.5


class ProgressBar(Protocol):
    """What the build's steps use of a tqdm bar."""

    total: float | None
    n: float

    def update(self, n: float = 1) -> object: ...


@contextlib.contextmanager
def build_step(desc: str, total: int | None = None, unit: str = "it") -> Iterator[ProgressBar]:
    """A tqdm bar (stderr, cleared when the step ends) for the step inside the block; the
    block may `update` it. Redrawn every _REDRAW_S seconds by a daemon thread."""
    from tqdm.auto import tqdm

    # A step with nothing to count shows its elapsed time alone.
    plain = "{desc} [{elapsed}]" if total is None and unit == "it" else None
    bar = tqdm(total=total, desc=desc, unit=unit, leave=False, dynamic_ncols=True, bar_format=plain)
    done = threading.Event()

    def redraw() -> None:
        while not done.wait(_REDRAW_S):
            bar.refresh()

    # Only a terminal is redrawn on the timer: in a log file each redraw would be another line.
    ticker = None
    if sys.stderr.isatty():
        ticker = threading.Thread(target=redraw, name="kiln-build-progress", daemon=True)
        ticker.start()
    try:
        yield bar
    finally:
        done.set()
        if ticker is not None:
            ticker.join()
        bar.close()


def counting(bar: ProgressBar) -> Callable[[int, int], None]:
    """A `progress(done, total)` callback (kiln.eval.perplexity's) that moves `bar`."""

    def report(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    return report
