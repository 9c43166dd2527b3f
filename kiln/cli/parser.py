"""The argument parser every verb uses: a wrong flag or value is one line, never the verb's
whole usage (`kiln serve`'s is 46 lines), and says "not supported" where a vLLM command line
asks for what kiln lacks."""

from __future__ import annotations

import argparse
import re
import sys
from typing import NoReturn

_INVALID_CHOICE = re.compile(
    r"argument (\S+?)(?:/\S+)?: invalid choice: '?([^'(]*?)'? \(choose from (.*)\)"
)
_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")


def one_line(message: str, prog: str) -> str:
    """argparse's message as kiln's one line: an unknown flag or a value outside the choices
    reads "not supported: ...", naming what kiln has instead."""
    if found := _INVALID_CHOICE.search(message):
        flag, value, choices = found.groups()
        choices = choices.replace("'", "")
        return f"not supported: {flag} {value} (kiln has: {choices})"
    if found := _UNRECOGNIZED.search(message):
        return f"not supported: {found.group(1)} (not a `{prog}` flag; `{prog} --help` lists them)"
    return message


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are `kiln VERB: error: ...` on one line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message, self.prog)}\n")


def exit_unsupported(prog: str, message: str) -> NoReturn:
    """Leave as a parser error would: one line on stderr, status 2."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
