"""Lines of a system prompt that change every request (an agent's per-request attribution or
billing header, a timestamp) change the prompt's first tokens, and a prefix cache keyed on the
tokens from the start then reuses nothing of the conversation after them: every turn a whole
re-prefill. Two rules, each a regex of lines:

- drop: the lines leave the prompt (Claude Code's billing header, which says nothing to the
  model: the default). The conversation's prefix stays the same from turn to turn.
- move: the lines go to the start of the conversation's last user (or tool) message, after the
  history, where the model still reads them. The prefix then holds up to the previous turn's
  last user message (the one that carried them the turn before).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Claude Code's attribution line ("x-anthropic-billing-header: cc_version=...; cch=...;"),
# which changes with every request.
DEFAULT_DROP_LINES = r"^x-anthropic-billing-header:.*$"


def compile_pattern(pattern: str | None) -> re.Pattern[str] | None:
    """None or "" turns a rule off; a bad regex is a ValueError naming it."""
    if not pattern:
        return None
    try:
        return re.compile(pattern, re.MULTILINE)
    except re.error as exc:
        raise ValueError(f"prompt line pattern {pattern!r} is not a valid regex: {exc}") from None


@dataclass(frozen=True)
class PromptLineRules:
    drop: re.Pattern[str] | None = None
    move: re.Pattern[str] | None = None

    @classmethod
    def parse(cls, drop: str | None, move: str | None) -> PromptLineRules | None:
        rules = cls(compile_pattern(drop), compile_pattern(move))
        return rules if rules.drop or rules.move else None

    def apply(self, conversation: list[dict]) -> list[dict]:
        """The conversation (chat-template dicts) with the rules applied to its system messages
        before the last user or tool message (unchanged when nothing matches)."""
        target = next(
            (
                i
                for i in reversed(range(len(conversation)))
                if conversation[i]["role"] in ("user", "tool")
            ),
            None,
        )
        if target is None:
            return conversation
        moved: list[str] = []
        out = []
        changed = False
        for i, message in enumerate(conversation):
            content = message.get("content")
            if message["role"] == "system" and isinstance(content, str) and i < target:
                kept = content
                if self.move is not None:
                    moved += [m.group(0) for m in self.move.finditer(kept)]
                    kept = self.move.sub("", kept)
                if self.drop is not None:
                    kept = self.drop.sub("", kept)
                if kept != content:
                    changed = True
                    message = {**message, "content": re.sub(r"\n{3,}", "\n\n", kept).strip("\n")}
            out.append(message)
        if not changed:
            return conversation
        if moved:
            last = out[target]
            text = "\n".join(moved) + "\n\n" + (last.get("content") or "")
            out[target] = {**last, "content": text}
        return out
