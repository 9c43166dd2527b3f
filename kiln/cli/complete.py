"""`kiln complete`: complete prompts on a running server (vLLM's `vllm complete`): one line a
prompt, the completion streamed; `-q PROMPT` completes one and exits."""

from __future__ import annotations

import argparse

from kiln.cli.server_client import add_client_args, connect, sampling, stream


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("complete", help="complete prompts on a running server (as `vllm complete`)")
    add_client_args(p)
    p.add_argument("-q", "--quick", default=None, metavar="PROMPT", help="one prompt, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    client, model = connect(args)

    def complete(prompt: str) -> None:
        body = {"model": model, "prompt": prompt, **sampling(args)}
        stream(client, "/completions", body, lambda choice: choice.get("text") or "")

    if args.quick is not None:
        complete(args.quick)
        return 0
    print(f"completing with {model} at {args.url} (Ctrl-D to leave)")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip():
            complete(line)
