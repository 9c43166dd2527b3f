"""mypy over kiln (pyproject.toml's [tool.mypy]) is part of the test suite, as ruff is."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_mypy_clean():
    assert importlib.util.find_spec("mypy"), "mypy is a test dependency: pip install -e '.[test]'"
    # The files and settings are pyproject.toml's; a cold run takes ~40 s on two cores.
    result = subprocess.run(
        [sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
