"""The package arrows run one way (engine -> executor -> runtime -> models -> layers/attention ->
kernels), and the control plane's core never needs torch. A new import that breaks the layering
fails here, before it grows into a cycle."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

KILN = pathlib.Path(__file__).resolve().parents[1] / "kiln"

# Which kiln packages (top-level folders or modules) each may import. Leaf modules every layer
# may use: errors, sampling_params, envs, tokenizer (the Tokenizer protocol).
LEAVES = {"errors", "sampling_params", "envs", "tokenizer"}
ALLOWED = {
    "interfaces": set(),
    "kv_cache": {"interfaces"},
    "engine": {"interfaces", "kv_cache", "executor", "config", "outputs", "structured_output"},
    "executor": {
        "interfaces",
        "runtime",
        "models",
        "config",
        "distributed",
        "checkpoint",
        "spec_decode",
    },
    "runtime": {
        "interfaces",
        "models",
        "layers",
        "attention",
        "kernels",
        "sampling",
        "checkpoint",
        "config",
        "structured_output",
        "distributed",
        "spec_decode",
        "kernel_cache",
    },
    "spec_decode": {"interfaces", "models", "layers", "attention", "kernels", "sampling", "config"},
    "models": {"layers", "attention", "kernels", "distributed"},
    "layers": {"kernels", "distributed"},
    "distributed": set(),
    # Build time: calibration walks the model's blocks; nothing below imports it back.
    "builder": {
        "attention",
        "checkpoint",
        "distributed",
        "eval",
        "kernel_cache",
        "kernels",
        "layers",
        "llm",
        "models",
        "runtime",
    },
    "attention": {"kernels"},
    "sampling": {"kernels"},
    "kernels": set(),
    "checkpoint": {"models"},
    "structured_output": set(),
    "kernel_cache": set(),
}


def _kiln_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kiln" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_packages_import_only_the_layers_below_them() -> None:
    wrong = []
    for package, allowed in ALLOWED.items():
        paths = [KILN / f"{package}.py"] if (KILN / f"{package}.py").exists() else []
        paths += sorted((KILN / package).rglob("*.py")) if (KILN / package).is_dir() else []
        assert paths, f"no files for {package}"
        for path in paths:
            bad = _kiln_imports(path) - allowed - LEAVES - {package}
            wrong += [f"{path.relative_to(KILN)} imports kiln.{b}" for b in sorted(bad)]
    assert not wrong, "\n".join(wrong)


def test_the_scheduler_and_kv_cache_need_no_torch() -> None:
    code = (
        "import sys, kiln.engine.scheduler, kiln.kv_cache.manager, kiln.interfaces;"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
