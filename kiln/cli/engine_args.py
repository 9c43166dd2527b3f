"""Command-line flags shared by every verb that starts an engine, and the sampling flags."""

from __future__ import annotations

import argparse
import ast
import functools
import inspect
import json
import types
import typing
from dataclasses import Field, fields

from kiln.cli.vllm_flags import DTYPE_ALIASES, add_vllm_engine_flags, check_vllm_engine_flags
from kiln.config import EngineConfig
from kiln.sampling_params import SamplingParams

# Spellings kiln shipped before the flags were generated, kept so scripts keep working:
# field -> an extra flag that sets it False.
_NEGATIVE_ALIASES = {"enable_prefix_caching": "--no-prefix-caching"}
# field -> another spelling of its flag.
_ALIASES = {
    "num_threads": "--threads",
    "tensor_parallel_size": "-tp",  # vLLM's short spellings
    "pipeline_parallel_size": "-pp",
}


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """The attribute docstrings of a dataclass (the string literal under each field), by field."""
    (node,) = ast.parse(inspect.getsource(cls)).body
    assert isinstance(node, ast.ClassDef)  # a class's source is its definition
    docs = {}
    for stmt, after in zip(node.body, node.body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[stmt.target.id] = inspect.cleandoc(after.value.value)
    return docs


def engine_fields() -> list[Field]:
    """The EngineConfig fields that are flags (all but those marked `metadata={"cli": False}`)."""
    return [f for f in fields(EngineConfig) if f.metadata.get("cli", True)]


def _flag_kwargs(f: Field, annotation: object, doc: str) -> dict:
    """add_argument's keywords for one field: type from the annotation, default and choices from
    the field, help from its docstring ("%" escaped: argparse formats help strings)."""
    kind = annotation
    if isinstance(kind, types.UnionType) or typing.get_origin(kind) is typing.Union:
        (kind,) = (a for a in typing.get_args(kind) if a is not type(None))
    text = doc.replace("%", "%%") + ("" if f.default is None else " (default: %(default)s)")
    kwargs: dict = {"default": f.default, "help": text}
    if kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction  # --x and --no-x
    elif kind in (int, float, str):
        kwargs["type"] = kind
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
            if f.name == "dtype":  # vLLM's names too (half, float, ...), mapped when parsed
                kwargs["choices"] = (*f.metadata["choices"], *DTYPE_ALIASES)
    elif kind is dict:  # JSON, as vLLM's --speculative-config '{"method": ...}'
        kwargs["type"] = _json_object
        kwargs["metavar"] = "JSON"
    else:
        raise TypeError(f"EngineConfig.{f.name}: no flag for type {annotation!r}")
    return kwargs


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field: `--field-name`, typed, defaulted and documented by it."""
    g = p.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    docs = field_docs(EngineConfig)
    for f in engine_fields():
        flag = "--" + f.name.replace("_", "-")
        kwargs = _flag_kwargs(f, hints[f.name], docs.get(f.name, ""))
        spellings = [flag, _ALIASES[f.name]] if f.name in _ALIASES else [flag]
        action = g.add_argument(*spellings, dest=f.name, **kwargs)
        action.help = kwargs["help"]  # Python 3.10's BooleanOptionalAction appends a 2nd default
        if f.name in _NEGATIVE_ALIASES:
            g.add_argument(
                _NEGATIVE_ALIASES[f.name],
                dest=f.name,
                action="store_false",
                default=argparse.SUPPRESS,  # the main flag sets the default
                help=f"same as --no-{flag[2:]}",
            )
    add_vllm_engine_flags(g)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    check_vllm_engine_flags(args)
    return EngineConfig(**{f.name: getattr(args, f.name) for f in engine_fields()})


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--logprobs", type=int, default=None)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
    )
