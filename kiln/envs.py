"""Every KILN_* environment variable kiln reads, typed, with its default and why, read once.

A field `name` is the variable `KILN_NAME`. Unset or empty means the default; a value that does not
parse raises a ValueError naming the variable. Code reads `envs().name`, never `os.environ`: one
place lists what the environment can change, and a typo in a value fails instead of being ignored.
The kernels read their switches at import, so a value must be set before kiln is imported.
"""

from __future__ import annotations

import functools
import os
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "KILN_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Envs:
    fused_linear_max_rows: int = 8
    """Most rows the fused small-batch linear kernels take (above it cuBLAS's GEMM tiles win). 0
    turns them off, the benchmarks' A/B switch; kernels.triton.small_batch_linear reads it at
    import."""
    fp8_small_batch_dot: bool = True
    """The FP8 small-batch kernels multiply float8 x float8 on the tensor cores; off (0) widens
    both operands to fp16 first (exact, more ALU work): the A/B of the two on the GPU."""
    small_batch_swap_ab: bool = True
    """The small-batch kernels over float8 weights multiply weight tile x input rows (the tile
    as the dot's first operand: a float8 wgmma straight from shared memory on Hopper) instead of
    input rows x weight tile (an HMMA on the tile widened to fp16 in registers); off (0) is the
    A/B (kernels.triton.small_batch_linear reads it at import)."""
    fp8_fast_accum: bool = True
    """The FP8 GEMMs (`torch._scaled_mm`) use Hopper's fast float8 accumulation (use_fast_accum:
    no periodic promotion of the partial sums to fp32), as vLLM's and TensorRT-LLM's FP8 GEMMs
    do: 7-12% faster at 2048-8192 rows, relative error against the fp32 product 2.1e-3 instead
    of 1.7e-3 (3.3e-3 at K=14336; docs/performance.md). Off (0): cuBLAS's promoted accumulation,
    the A/B; kernels.triton.fp8_gemm reads it at import."""
    cpu_fake_graphs: bool = False
    """Capture decode "graphs" on the CPU with FakeGraph, which re-runs the captured forward at
    replay (never faster): how tests run the graph path end to end without a GPU, under tensor
    parallelism too (every rank captures the same keys in the same order, collectives inside).
    Read by the model runner; worker ranks inherit it from the driver's environment."""
    small_batch_tiles: str | None = None
    """A JSON file written by benchmarks/fp8_small_batch_sweep.py: its suggested launch shapes
    (split-K factors, tiles) override the small-batch kernels' table, the end-to-end A/B of a
    sweep's choice before it is written into kernels.triton.small_batch_tiles (read at import)."""
    grammar_fill_threads: int = 0
    """Threads that fill a step's grammar masks (structured output); 0: half the CPUs the process
    may run on, at most 8 (kiln.structured_output.matchers)."""
    engine_kernel_cache: bool = True
    """Loading an engine directory built on a GPU copies its compiled Triton kernels into the
    Triton cache when the GPU and Triton match (kiln.kernel_cache); off (0): compile as without
    them, the A/B of a first process's start (benchmarks/build_and_first_token.py)."""
    engine_prehash: bool = True
    """`LLM(engine dir)` hashes the weight shards in a child process while torch imports, on
    hosts of 4 cores or more (kiln.checkpoint.prehash); off (0): the loader hashes as it reads,
    the A/B of a cold start."""
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
    values = {}
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
    what a benchmark's JSON records, so an A/B of a switch says which side it was."""
    return {
        PREFIX + f.name.upper(): getattr(env, f.name)
        for f in fields(Envs)
        if f.name not in _SECRET and getattr(env, f.name) != f.default
    }


@functools.cache
def envs() -> Envs:
    """The process's variables, read on first use and fixed from then on."""
    return read_envs()
