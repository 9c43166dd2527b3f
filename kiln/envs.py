"""Every KILN_* environment variable kiln reads, typed, with its default and why, read once.

A field `name` is the variable `KILN_NAME`. Unset or empty means the default; a value that does not
parse raises a ValueError naming the variable. Code reads `envs().name`, never `os.environ`: one
place lists what the environment can change, and a typo in a value fails instead of being ignored.
No variable switches a kernel or a feature: a real user choice is an EngineConfig field. The values
are read once, on first use.
"""

from __future__ import annotations

import functools
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

PREFIX = "KILN_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Envs:
    cpu_fake_graphs: bool = False
    """Capture decode "graphs" on the CPU with FakeGraph, which re-runs the captured forward at
    replay (never faster): how tests run the graph path end to end without a GPU, under tensor
    parallelism too (every rank captures the same keys in the same order, collectives inside).
    Read by the model runner; worker ranks inherit it from the driver's environment."""
    grammar_fill_threads: int = 0
    """Threads that fill a step's grammar masks (structured output); 0: half the CPUs the process
    may run on, at most 8 (kiln.structured_output.matchers)."""
    api_key: str | None = None
    """Default of `kiln serve --api-key`: a key kept off the command line (and so out of `ps`)."""
    git_revision: str | None = None
    """The revision benchmark records name when the tree has no .git (a copy on a GPU machine);
    None: ask git."""
    worker_config: str | None = None
    """Set by kiln's own launcher (kiln.executor.multiproc) for the rank processes it starts, not
    by users: the engine config as JSON."""
    worker_init_method: str | None = None
    """Likewise: the rendezvous of kiln-started ranks (tcp://127.0.0.1:PORT); None: env://
    (torchrun's MASTER_ADDR/MASTER_PORT)."""


def _parse(name: str, kind: object, text: str) -> object:
    if isinstance(kind, types.UnionType):  # `X | None`: an unset variable is already the None
        (kind,) = (a for a in typing.get_args(kind) if a is not type(None))
    if kind is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ValueError(f"{name} must be one of {', '.join(_TRUE + _FALSE)}, got {text!r}")
    if kind is int:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{name} must be an integer, got {text!r}") from None
    if kind is str:
        return text
    raise TypeError(f"Envs: no parser for {name}'s type {kind!r}")


def read_envs(environ: Mapping[str, str] | None = None) -> Envs:
    """The variables of `environ` (default: the process's), parsed; unset or empty ones default."""
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(Envs)
    values: dict[str, Any] = {}  # each parsed to its field's type
    for f in fields(Envs):
        name = PREFIX + f.name.upper()
        text = environ.get(name, "")
        if text:
            values[f.name] = _parse(name, hints[f.name], text)
    return Envs(**values)


# Values no record may carry.
_SECRET = frozenset({"api_key"})


def changed(env: Envs) -> dict[str, object]:
    """The variables `env` sets away from their defaults, by variable name (secrets left out):
    what a benchmark's JSON records."""
    return {
        PREFIX + f.name.upper(): getattr(env, f.name)
        for f in fields(Envs)
        if f.name not in _SECRET and getattr(env, f.name) != f.default
    }


@functools.cache
def envs() -> Envs:
    """The process's variables, read on first use and fixed from then on."""
    return read_envs()
