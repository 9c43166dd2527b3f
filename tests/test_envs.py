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
        prefetch_fp8_v=True, fused_linear_max_rows=8, api_key=None, git_revision=None
    )


def test_set_values_are_parsed():
    env = read_envs(
        {
            "KILN_PREFETCH_FP8_V": "0",
            "KILN_FUSED_LINEAR_MAX_ROWS": "0",
            "KILN_API_KEY": "sk-test",
            "KILN_GIT_REVISION": "abc123",
            "HOME": "/nowhere",
        }
    )
    assert env == Envs(
        prefetch_fp8_v=False, fused_linear_max_rows=0, api_key="sk-test", git_revision="abc123"
    )
    assert read_envs({"KILN_PREFETCH_FP8_V": "1"}).prefetch_fp8_v is True
    assert read_envs({"KILN_PREFETCH_FP8_V": "off"}).prefetch_fp8_v is False
    assert read_envs({"KILN_API_KEY": ""}).api_key is None  # empty is unset


def test_changed_names_the_switches_set_and_never_the_api_key():
    # What a benchmark's JSON records (kiln.bench.report.environment): the A/B side it ran.
    assert changed(Envs()) == {}
    env = read_envs(
        {"KILN_DECODE_STREAM_K": "1", "KILN_KV_CACHE_LAYOUT": "token", "KILN_API_KEY": "sk-x"}
    )
    assert changed(env) == {"KILN_DECODE_STREAM_K": True, "KILN_KV_CACHE_LAYOUT": "token"}
    assert changed(read_envs({"KILN_DECODE_PACKED": "1"})) == {}  # the default, set explicitly


@pytest.mark.parametrize(
    ("name", "value"), [("KILN_FUSED_LINEAR_MAX_ROWS", "eight"), ("KILN_PREFETCH_FP8_V", "2")]
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
