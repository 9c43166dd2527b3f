"""Tool calls on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`.

request.py turns the request into a ToolPlan (tools for the chat template; a grammar for
`required` and a named function, so the call is valid JSON for the function's parameters);
parsers.py reads a model's own tool-call format for `auto` (Hermes / Qwen2.5 `<tool_call>`,
Llama 3.1 JSON); stream.py holds back what may be a tool call while streaming and emits the
calls as OpenAI's `tool_calls` deltas.
"""

from kiln.server.tool_calls.parsers import PARSERS, ToolCall, detect_parser, get_parser
from kiln.server.tool_calls.request import ToolPlan, apply_plan, plan_tools
from kiln.server.tool_calls.stream import ToolCallStream

__all__ = [
    "PARSERS",
    "ToolCall",
    "ToolCallStream",
    "ToolPlan",
    "apply_plan",
    "detect_parser",
    "get_parser",
    "plan_tools",
]
