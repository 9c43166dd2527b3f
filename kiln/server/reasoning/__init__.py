"""Reasoning parsers (vLLM's `--reasoning-parser` names): a reasoning model's `<think>` block
becomes `reasoning_content` in chat, a reasoning item in Responses, a thinking block in Messages."""

from kiln.server.reasoning.parsers import (
    REASONING_PARSERS,
    ReasoningParser,
    ReasoningScanner,
    get_reasoning_parser,
)

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningScanner", "get_reasoning_parser"]
