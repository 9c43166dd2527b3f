"""Running a kernel-compiling test file as a script: Triton's interpreter replaces the kernels'
JIT functions, so a compile for a GPU target needs a process without TRITON_INTERPRET; and
ptxas's report (registers, spills) of a compiled kernel's PTX."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
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


def ptxas_report(ptx: str) -> str:
    """ptxas -v's report (registers, spill stores and loads) of a kernel's PTX for sm_90a, from
    the ptxas that ships with the Triton this process imports."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.ptx"
        path.write_text(ptx)
        out = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", str(path), "-o",
                              str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout + out.stderr


def spilled_bytes(report: str) -> tuple[int, int]:
    """(spill stores, spill loads) in bytes from a ptxas -v report."""
    found = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    assert found is not None, report
    return int(found[1]), int(found[2])
