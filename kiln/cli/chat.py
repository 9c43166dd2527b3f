"""`kiln chat`: talk to a running server (vLLM's `vllm chat`): one line a turn, the reply
streamed, the conversation kept; `-q MESSAGE` sends one and exits."""

from __future__ import annotations

import argparse

from kiln.cli.server_client import add_client_args, connect, sampling, stream


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a running server (as `vllm chat`)")
    add_client_args(p)
    p.add_argument("--system-prompt", default=None)
    p.add_argument("-q", "--quick", default=None, metavar="MESSAGE", help="one turn, then exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    client, model = connect(args)
    messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []

    def turn(text: str) -> None:
        messages.append({"role": "user", "content": text})
        body = {"model": model, "messages": messages, **sampling(args)}
        reply = stream(client, "/chat/completions", body, _delta)
        messages.append({"role": "assistant", "content": reply})

    if args.quick is not None:
        turn(args.quick)
        return 0
    print(f"chatting with {model} at {args.url} (Ctrl-D to leave)")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if line.strip():
            turn(line)


def _delta(choice: dict) -> str:
    return (choice.get("delta") or {}).get("content") or ""
