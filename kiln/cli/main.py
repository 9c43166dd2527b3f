"""`kiln` command line: one sub-command per verb, each in its own module.

A verb module imports only the standard library and kiln's light modules at its top; its heavy
dependencies (torch, transformers, fastapi, uvicorn) are imported inside its `run`, so `kiln --help`
is quick and a verb works on a machine without another verb's dependencies (`kiln bench` and
`kiln generate` run where fastapi is not installed). An import error in a verb module is a bug,
raised rather than hidden.
"""

from __future__ import annotations

import logging
import sys

import kiln
from kiln.cli import bench, build, chat, complete, eval, generate, serve
from kiln.cli.parser import OneLineParser, exit_unsupported, one_line
from kiln.errors import KilnError

VERBS = (generate, serve, bench, build, eval, chat, complete)


def main(argv: list[str] | None = None) -> int:
    parser = OneLineParser(prog="kiln", description="kiln LLM inference engine")
    parser.add_argument("--version", action="version", version=f"kiln {kiln.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for verb in VERBS:
        verb.add_parser(sub)
    args, extra = parser.parse_known_args(argv)
    if extra:  # named with the verb (and mode) it was given to, in one line
        mode = getattr(args, "mode", None)
        prog = " ".join(["kiln", args.command, *([mode] if mode else [])])
        exit_unsupported(prog, one_line(f"unrecognized arguments: {' '.join(extra)}", prog))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # What the engine starts with (model, dtype, threads, memory plan, KV capacity), as vLLM
    # says it: INFO lines on stderr, the verbs' output on stdout unchanged.
    logging.getLogger("kiln.startup").setLevel(logging.INFO)
    try:
        return int(args.func(args) or 0)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
