"""Running a kernel-compiling test file as a script: Triton's interpreter replaces the kernels'
JIT functions, so a compile for a GPU target needs a process without TRITON_INTERPRET."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def compiled_in_subprocess(script: str) -> Any:
    """What `script` (a test file whose __main__ prints JSON) prints, run without
    TRITON_INTERPRET, this tree first on its path."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True,
                         timeout=600, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)
