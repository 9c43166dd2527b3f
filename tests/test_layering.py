"""The package arrows run one way, top to bottom (ARCHITECTURE.md's layer diagram):

    cli -> server -> llm.py / engine_core / engine -> executor -> runtime -> spec_decode
        -> models -> layers / attention -> kernels

with builder/, bench/ and eval/ as tools beside the stack: they drive the public API and may
import what they need, but only cli/ imports them. The control plane's core never needs torch.
A new import that breaks the layering fails here, before it grows into a cycle."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

KILN = pathlib.Path(__file__).resolve().parents[1] / "kiln"

# Leaf modules every layer may use; they import nothing of kiln but each other (tokenizer: the
# Tokenizer protocol the loader, the engine and the server hold).
LEAVES = {"errors", "sampling_params", "envs", "tokenizer"}
# Tools: they may import any layer; nothing imports them back except the CLI (and each other).
TOOLS = {"builder", "bench", "eval"}

# What each kiln package (top-level folder) or top-level module may import, besides LEAVES and
# itself. An entry names a package, or one module of it ("spec_decode.config") where a layer
# needs only that module. Every file under kiln/ belongs to exactly one key.
ALLOWED: dict[str, set[str]] = {
    # The user-facing top.
    "cli": {
        "bench",
        "builder",
        "config",
        "engine",
        "engine_core",
        "eval",
        "llm",
        "lora.request",
        "server",
    },
    "server": {"config", "engine", "engine_core", "lora.request", "outputs"},
    # The package root: the offline API's names (LLM lazily).
    "__init__": {"config", "llm", "lora.request", "outputs"},
    # Tools beside the stack.
    "builder": {
        "attention",
        "checkpoint",
        "distributed",
        "eval",
        "kernel_cache",
        "kernels",
        "layers",
        "llm",
        "lora.peft",
        "models",
        "runtime",
    },
    "bench": {
        "checkpoint",
        "config",
        "engine",
        "kernel_cache",
        "lora",
        "models",
        "runtime",
        "spec_decode",
    },
    "eval": set(),
    # The control plane: pure Python, no tensors.
    "llm": {"checkpoint", "config", "engine", "lora.request", "outputs"},
    # The engine's process and its client; the client finds the model source before it starts
    # the engine process (runtime.model_loader, imported lazily).
    "engine_core": {"config", "engine", "lora.request", "outputs", "runtime"},
    "engine": {
        "config",
        "executor",
        "interfaces",
        "kv_cache",
        "lora.request",
        "lora.slots",
        "outputs",
        "structured_output",
    },
    "kv_cache": {"interfaces"},
    "interfaces": set(),
    # EngineConfig validates and parses speculative_config with spec_decode's plain dataclass.
    "config": {"spec_decode.config"},
    "outputs": set(),
    "tokenizer": set(),
    # The data plane.
    "executor": {
        "checkpoint",
        "config",
        "distributed",
        "interfaces",
        "lora",
        "models",
        "runtime",
        "spec_decode",
    },
    "runtime": {
        "attention",
        "checkpoint",
        "config",
        "distributed",
        "interfaces",
        "kernel_cache",
        "kernels",
        "layers",
        "lora",
        "models",
        "sampling",
        "spec_decode",
        "structured_output",
    },
    "spec_decode": {"attention", "config", "kernels", "layers", "models", "sampling"},
    # LoRA: the request and slot book (pure Python, for the control plane: its modules
    # request.py and slots.py import no layer), the adapter reader and the layers' LoRA method.
    "lora": {"layers", "models"},
    "structured_output": set(),
    "sampling": {"kernels"},
    "checkpoint": {"models"},
    "models": {"attention", "distributed", "kernels", "layers"},
    # Run-time linear methods only: build-time calibration lives in builder/calibrate/.
    "layers": {"distributed", "kernels"},
    "attention": {"kernels"},
    "kernels": set(),
    # The manifest's digest, to hash carried kernels as they are installed.
    "kernel_cache": {"checkpoint.file_hash"},
    "distributed": set(),
    "errors": set(),
    "sampling_params": set(),
    "envs": set(),
}

# A lazy import by name ("kiln.attention.torch_backend:TorchAttentionBackend") is an import too.
_MODULE_STRING = re.compile(r"kiln(\.[A-Za-z_]\w*)+(:\w+)?")


def _kiln_imports(path: pathlib.Path) -> set[str]:
    """The kiln modules `path` imports, without the "kiln." prefix ("engine.scheduler"):
    import statements (TYPE_CHECKING and function-level ones included) and module names in
    strings (logger names aside). `import kiln` alone (the package root, for __version__) is
    not counted."""
    tree = ast.parse(path.read_text())
    logger_names = {
        id(arg)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "attr", getattr(node.func, "id", None)) == "getLogger"
        for arg in node.args
    }
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "kiln":
                names = [f"kiln.{a.name}" for a in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _MODULE_STRING.fullmatch(node.value)
            and id(node) not in logger_names
        ):
            names = [node.value.split(":")[0]]
        for name in names:
            parts = name.split(".")
            if parts[0] == "kiln" and len(parts) > 1:
                found.add(".".join(parts[1:]))
    return found


def _owner(path: pathlib.Path) -> str:
    """The ALLOWED key a file under kiln/ belongs to."""
    first = path.relative_to(KILN).parts[0]
    return first.removesuffix(".py")


def _files(package: str) -> list[pathlib.Path]:
    paths = [KILN / f"{package}.py"] if (KILN / f"{package}.py").exists() else []
    paths += sorted((KILN / package).rglob("*.py")) if (KILN / package).is_dir() else []
    return paths


def _permitted(module: str, package: str) -> bool:
    top = module.split(".")[0]
    if top == package or top in LEAVES:
        return True
    return any(module == a or module.startswith(a + ".") for a in ALLOWED[package])


def _importers_of(target: str, under: str) -> list[str]:
    """'file imports kiln.module' for each file under kiln/<under> that imports kiln/<target>."""
    hits = []
    for path in _files(under):
        for module in sorted(_kiln_imports(path)):
            if module.split(".")[0] == target:
                hits.append(f"{path.relative_to(KILN)} imports kiln.{module}")
    return hits


def test_every_kiln_file_is_in_the_table() -> None:
    owners = {_owner(p) for p in KILN.rglob("*.py")}
    assert not owners - ALLOWED.keys(), f"add to ALLOWED: {sorted(owners - ALLOWED.keys())}"
    assert not ALLOWED.keys() - owners, f"no files for {sorted(ALLOWED.keys() - owners)}"


def test_packages_import_only_the_layers_below_them() -> None:
    wrong = []
    for package in ALLOWED:
        for path in _files(package):
            bad = [m for m in _kiln_imports(path) if not _permitted(m, package)]
            wrong += [f"{path.relative_to(KILN)} imports kiln.{m}" for m in sorted(bad)]
    assert not wrong, "\n".join(wrong)


def test_the_table_runs_one_way() -> None:
    """ALLOWED itself has no cycle, and only the CLI imports the tools or the server; a
    widened entry that would let an arrow run back fails here, not in a later review."""
    for package, allowed in ALLOWED.items():
        assert not allowed & LEAVES, f"{package}: leaves are always allowed, drop them"
        if package not in TOOLS | {"cli"}:
            assert not allowed & TOOLS, f"{package} may not import the tools {allowed & TOOLS}"
        if package != "cli":
            assert "server" not in allowed and "cli" not in allowed, package
    for leaf in LEAVES:
        assert not ALLOWED[leaf], f"{leaf} is a leaf: it imports only other leaves"

    # Depth-first search for a cycle; "spec_decode.config" is an edge to one module, which
    # itself imports no other layer, so it ends the path.
    edges = {p: {a for a in allowed if "." not in a} for p, allowed in ALLOWED.items()}
    state: dict[str, str] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(edges[node]):
            assert state.get(nxt) != "open", "cycle: " + " -> ".join([*path, node, nxt])
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = "done"

    for package in sorted(edges):
        if package not in state:
            visit(package, [])


def test_the_server_does_not_import_the_cli() -> None:
    hits = _importers_of("cli", "server")
    assert not hits, "the server sits below the CLI; move shared code into kiln/server:\n" + (
        "\n".join(hits)
    )


def test_layers_and_models_do_not_import_build_time_calibration() -> None:
    hits = _importers_of("builder", "layers") + _importers_of("builder", "models")
    assert not hits, (
        "calibration is build-time code (kiln/builder/calibrate) that walks the model's blocks; "
        "the run-time layers and models never import it back:\n" + "\n".join(hits)
    )


def test_layers_do_not_import_models() -> None:
    hits = _importers_of("models", "layers")
    assert not hits, "layers are below models; a layer never imports a model:\n" + "\n".join(hits)


def test_the_scheduler_and_kv_cache_need_no_torch() -> None:
    code = (
        "import sys, kiln.engine.scheduler, kiln.kv_cache.manager, kiln.interfaces;"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
