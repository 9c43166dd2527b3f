"""An agent's multi-turn transcript whose system prompt starts with a line that changes every
request (Claude Code's attribution header): measured as the prefix cache's hit rate over the
turns after the first, with the line dropped (the default), moved after the history, and left
in place.
Through the anthropic SDK on the tiny chat model; usage.cache_read_input_tokens is the engine's
count of prompt tokens its prefix cache served."""

from __future__ import annotations

import itertools
import uuid

import pytest

from kiln.server.volatile_lines import DEFAULT_DROP_LINES, PromptLineRules, compile_pattern
from tests.lazy_import import lazy_import
from tests.server_harness import ServerThread, tiny_chat_engine

anthropic = lazy_import("anthropic")

pytestmark = pytest.mark.timeout(300)
MODEL = "tiny"
TASKS = [
    "Read the file main.py and list its functions.",
    "Now add a docstring to the first one.",
    "Run the tests and tell me which ones fail.",
    "Fix the failing test in test_io.py.",
    "Commit the change with a short message.",
    "Open a pull request for it.",
]


def _transcript_hit_rate(drop: str | None, move: str | None, topic: str) -> tuple[float, list[int]]:
    from kiln.server.app import build_app

    app = build_app(tiny_chat_engine(), MODEL, drop_prompt_lines=drop, volatile_prompt_lines=move)
    with ServerThread(app) as srv:
        client = anthropic.Anthropic(base_url=srv.base_url, api_key="-", max_retries=0)
        messages: list[dict] = []
        cached, total = [], []
        for turn, task in enumerate(TASKS):
            header = (
                f"x-anthropic-billing-header: cc_version=2.0.{turn}; cch={uuid.uuid4().hex[:5]};"
            )
            system = [
                {"type": "text", "text": header},
                {"type": "text", "text": f"You are a coding agent working on {topic}."},
            ]
            messages.append({"role": "user", "content": task})
            reply = client.messages.create(
                model=MODEL,
                system=system,
                messages=messages,
                max_tokens=8,
                extra_body={"temperature": 0},
            )
            messages.append({"role": "assistant", "content": reply.content[0].text})
            cached.append(reply.usage.cache_read_input_tokens)
            total.append(reply.usage.input_tokens)
    return sum(cached[1:]) / sum(total[1:]), cached


def test_a_changing_header_line_does_not_force_a_re_prefill():
    dropped, cached_dropped = _transcript_hit_rate(DEFAULT_DROP_LINES, None, "the kiln repository")
    moved, cached_moved = _transcript_hit_rate(None, DEFAULT_DROP_LINES, "a chess engine")
    in_place, cached_in_place = _transcript_hit_rate(None, None, "a weather app")
    print(
        f"prefix hit rate, turns 2-6: header dropped {dropped:.2f}, moved {moved:.2f}, "
        f"in place {in_place:.2f}"
    )
    assert in_place < 0.15, cached_in_place  # the header's first block at most
    assert moved > 0.45, cached_moved  # all but the last turn's user message and reply
    assert dropped > 0.75, cached_dropped
    for cached in (cached_dropped, cached_moved):
        assert all(b > a for a, b in itertools.pairwise(cached[1:]))  # grows with the history


def test_the_rules_on_a_conversation():
    header = "x-anthropic-billing-header: cch=1;"
    conversation = [
        {"role": "system", "content": f"{header}\nBe helpful."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    moved = PromptLineRules.parse(None, DEFAULT_DROP_LINES).apply(conversation)
    assert moved[0]["content"] == "Be helpful." and moved[1:3] == conversation[1:3]
    assert moved[3]["content"] == f"{header}\n\nAgain"
    dropped = PromptLineRules.parse(DEFAULT_DROP_LINES, None).apply(conversation)
    assert dropped == [{"role": "system", "content": "Be helpful."}, *conversation[1:]]
    assert PromptLineRules.parse(None, "") is None  # both off
    rules = PromptLineRules.parse(DEFAULT_DROP_LINES, None)
    assert rules.apply(conversation[:1]) == conversation[:1]  # no user turn after it
    assert rules.apply(conversation[1:]) == conversation[1:]  # nothing matches
    with pytest.raises(ValueError, match="not a valid regex"):
        compile_pattern("(")
