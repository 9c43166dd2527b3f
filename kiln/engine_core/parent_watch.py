"""The engine process ends with its parent while it starts: loading a model takes seconds to
minutes, and an API process stopped meanwhile (SIGTERM, SIGKILL, a crash) must not leave an
engine loading for nobody. Once started, the serve loop checks its parent itself (and finishes
the steps it has first)."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

POLL_S = 0.1  # how soon a loading engine notices that its parent is gone
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def kill_with_parent_thread() -> bool:
    """Linux: have the kernel SIGKILL this process when the thread that started it exits (no
    GIL needed: a model load holding it for seconds cannot delay it). Run between fork and exec
    (Popen's preexec_fn; the setting survives exec), for a process started from its parent's
    main thread, whose exit is the parent's. False where unavailable."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class ParentWatch:
    """A daemon thread that ends this process (os._exit) when its parent `parent_pid` is gone,
    until `stop()`: everywhere, whichever thread started it (prctl's death signal follows the
    starting thread, so it is used only beside this, for a parent's main thread)."""

    def __init__(self, parent_pid: int) -> None:
        self._parent_pid = parent_pid
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kiln-parent-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            if os.getppid() != self._parent_pid:
                os._exit(0)  # nothing to clean: nothing was served

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()
