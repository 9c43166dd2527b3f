"""`kiln` command line: one sub-command per verb, each in its own module."""

from __future__ import annotations

import argparse
import logging
import sys

from kiln.errors import KilnError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kiln", description="kiln LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    from kiln.cli import generate

    generate.add_parser(sub)
    for name in ("serve", "bench"):  # verbs that land with their own modules
        try:
            module = __import__(f"kiln.cli.{name}", fromlist=["add_parser"])
        except ImportError:
            continue
        module.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
