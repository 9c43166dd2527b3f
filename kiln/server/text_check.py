"""One check for every string a request carries: no lone surrogates.

JSON may spell a UTF-16 surrogate alone ("\\ud800"); Python decodes it into a str that cannot be
encoded, so wherever such a string goes (the tokenizer, a stop string, a tool name, a grammar, the
engine's message encoder) it fails with a 500. Checked once per request, over every string and
key of the parsed body, and only when the raw bytes hold a surrogate escape at all (a C-speed
scan), so an ordinary request pays one regex search.
"""

from __future__ import annotations

import json
import re

from kiln.errors import InvalidRequestError

# A JSON escape of a UTF-16 surrogate, high or low (pairs too: the walk tells them apart).
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def may_hold_surrogates(raw: bytes) -> bool:
    return SURROGATE_ESCAPE.search(raw) is not None


def lone_surrogate(value: object) -> tuple[str, int] | None:
    """(path, character) of the first string or key in `value` (parsed JSON) holding a lone
    surrogate, e.g. ("messages[0].content", 3); None if every string is valid Unicode."""
    stack: list[tuple[str, object]] = [("", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return path or "body", exc.start
        elif isinstance(item, dict):
            for key, child in reversed(list(item.items())):
                child_path = f"{path}.{key}" if path else str(key)
                stack.append((child_path, child))
                stack.append((f"{child_path} (the key)", key))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", child) for i, child in reversed(list(enumerate(item))))
    return None


def check_strings(value: object) -> None:
    """400 (InvalidRequestError naming the top-level field) on a lone surrogate in `value`."""
    found = lone_surrogate(value)
    if found is None:
        return
    path, index = found
    param = re.split(r"[.\[ ]", path, maxsplit=1)[0]
    raise InvalidRequestError(
        f"{path} is not valid Unicode: a lone surrogate at character {index}", param=param
    )


def check_json_body(raw: bytes) -> InvalidRequestError | None:
    """The error for a JSON body holding a lone surrogate anywhere; None if it holds none or is
    not JSON (the route reports that)."""
    if not may_hold_surrogates(raw):
        return None
    try:
        value = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    try:
        check_strings(value)
    except InvalidRequestError as exc:
        return exc
    return None
