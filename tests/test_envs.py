"""kiln.envs: every KILN_* variable in one typed registry, and nothing else reads them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from kiln.envs import Envs, changed, read_envs

KILN = Path(__file__).resolve().parent.parent / "kiln"


def test_defaults():
    assert read_envs({}) == Envs()
    assert read_envs({}) == Envs(
        cpu_fake_graphs=False, grammar_fill_threads=0, api_key=None, git_revision=None
    )


def test_set_values_are_parsed():
    env = read_envs(
        {
            "KILN_CPU_FAKE_GRAPHS": "1",
            "KILN_GRAMMAR_FILL_THREADS": "3",
            "KILN_API_KEY": "sk-test",
            "KILN_GIT_REVISION": "abc123",
            "HOME": "/nowhere",
        }
    )
    assert env == Envs(
        cpu_fake_graphs=True, grammar_fill_threads=3, api_key="sk-test", git_revision="abc123"
    )
    assert read_envs({"KILN_CPU_FAKE_GRAPHS": "yes"}).cpu_fake_graphs is True
    assert read_envs({"KILN_CPU_FAKE_GRAPHS": "off"}).cpu_fake_graphs is False
    assert read_envs({"KILN_API_KEY": ""}).api_key is None  # empty is unset


def test_changed_names_the_variables_set_and_never_the_api_key():
    # What a benchmark's JSON records (kiln.bench.report.environment).
    assert changed(Envs()) == {}
    env = read_envs(
        {"KILN_GRAMMAR_FILL_THREADS": "2", "KILN_GIT_REVISION": "abc", "KILN_API_KEY": "sk-x"}
    )
    assert changed(env) == {"KILN_GRAMMAR_FILL_THREADS": 2, "KILN_GIT_REVISION": "abc"}
    assert changed(read_envs({"KILN_CPU_FAKE_GRAPHS": "0"})) == {}  # the default, set explicitly


@pytest.mark.parametrize(
    ("name", "value"), [("KILN_GRAMMAR_FILL_THREADS", "eight"), ("KILN_CPU_FAKE_GRAPHS", "2")]
)
def test_a_bad_value_names_the_variable(name, value):
    with pytest.raises(ValueError, match=name):
        read_envs({name: value})


def _reads_kiln_env(node: ast.AST) -> bool:
    """os.environ.get("KILN_..."), os.environ["KILN_..."], os.getenv("KILN_..."), and the same
    through a bare `environ` / `getenv` import."""

    def is_env(expr: ast.AST) -> bool:
        name = expr.attr if isinstance(expr, ast.Attribute) else getattr(expr, "id", "")
        return name in ("environ", "getenv")

    def is_kiln(expr: ast.AST | None) -> bool:
        return isinstance(expr, ast.Constant) and str(expr.value).startswith("KILN_")

    if isinstance(node, ast.Subscript):
        return is_env(node.value) and is_kiln(node.slice)
    if isinstance(node, ast.Call) and node.args and is_kiln(node.args[0]):
        func = node.func
        return is_env(func) or (isinstance(func, ast.Attribute) and is_env(func.value))
    return False


def test_only_envs_py_reads_kiln_variables():
    offenders = []
    for path in sorted(KILN.rglob("*.py")):
        if path == KILN / "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if _reads_kiln_env(node):
                offenders.append(f"{path.relative_to(KILN.parent)}:{node.lineno}")
    assert not offenders, "read KILN_* through kiln.envs: " + ", ".join(offenders)


def test_the_check_catches_a_direct_read():
    for code in ('os.environ.get("KILN_X", "1")', 'os.environ["KILN_X"]', 'os.getenv("KILN_X")'):
        assert any(_reads_kiln_env(n) for n in ast.walk(ast.parse(code))), code
