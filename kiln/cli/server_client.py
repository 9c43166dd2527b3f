"""What `kiln chat` and `kiln complete` share: a running OpenAI-compatible server (kiln's,
vLLM's, ...) reached over HTTP, its replies streamed to the terminal as they come."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kiln.envs import envs
from kiln.errors import KilnError

if TYPE_CHECKING:
    import httpx

DEFAULT_URL = "http://localhost:8000/v1"


def add_client_args(p: argparse.ArgumentParser) -> None:
    """vLLM's `vllm chat` / `vllm complete` flags, and the sampling ones they send."""
    p.add_argument("--url", default=DEFAULT_URL, help="the server's /v1 (default: %(default)s)")
    p.add_argument("--model-name", default=None, help="default: the server's first model")
    p.add_argument(
        "--api-key", default=envs().api_key, help="the server's key (default: $KILN_API_KEY)"
    )
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None, help="default: the server's")


def connect(args: argparse.Namespace) -> tuple[httpx.Client, str]:
    """A client of the server and the model to name (asked of /v1/models unless given)."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=None)
    if args.model_name:
        return client, args.model_name
    try:
        reply = client.get("/models")
    except httpx.HTTPError as exc:
        raise KilnError(f"no server at {args.url} ({exc}): start one with `kiln serve`") from None
    _check(reply)
    return client, reply.json()["data"][0]["id"]


def stream(
    client: httpx.Client, path: str, body: dict[str, Any], piece: Callable[[dict], str]
) -> str:
    """POST `body` with stream on, print each chunk's `piece` as it arrives; the whole text."""
    parts = []
    with client.stream("POST", path, json={**body, "stream": True}) as reply:
        if reply.status_code != 200:
            reply.read()
            _check(reply)
        for line in reply.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise KilnError(f"the server: {event['error'].get('message')}")
            text = "".join(piece(choice) for choice in event.get("choices", ()))
            print(text, end="", flush=True)
            parts.append(text)
    print()
    return "".join(parts)


def sampling(args: argparse.Namespace) -> dict[str, Any]:
    """The sampling fields given on the command line (the rest are the server's defaults)."""
    fields = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    return {k: v for k, v in fields.items() if v is not None}


def _check(reply: httpx.Response) -> None:
    if reply.status_code == 200:
        return
    try:
        message = reply.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = reply.text[:300]
    raise KilnError(f"the server answered {reply.status_code}: {message}")
