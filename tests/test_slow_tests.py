"""tests/slow_tests.py names tests that exist: a renamed or moved test would otherwise leave the
fast run (`pytest -m "not slow"`) silently longer."""

from __future__ import annotations

import re
from pathlib import Path

from tests.slow_tests import SLOW_TESTS

ROOT = Path(__file__).resolve().parent.parent


def test_every_slow_test_named_exists():
    missing = []
    for node in sorted(SLOW_TESTS):
        path, *names = node.split("::")
        source = ROOT / path
        if not source.is_file() or not re.search(
            rf"^\s*(async )?def {re.escape(names[-1])}\(", source.read_text(), re.M
        ):
            missing.append(node)
    assert missing == []


def test_the_readme_and_ci_run_the_same_full_command_and_a_fast_one():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    full = "python -m pytest -q -p no:cacheprovider"
    ci_command = [line for line in ci.splitlines() if full in line]
    assert len(ci_command) == 1 and ci_command[0].endswith(full)  # CI: the whole suite
    assert ci_command[0] in readme  # the README's full command, character for character
    assert f'{full} -m "not slow"' in readme
