"""Tool calls on chat completions: `tools`, `tool_choice`, `parallel_tool_calls`.

request.py turns the request into a ToolPlan (tools for the chat template; a grammar for
`required` and a named function, so the call is valid JSON for the function's parameters);
parsers.py reads a model's own tool-call format for `auto` (Hermes / Qwen `<tool_call>`,
Llama 3.1 JSON, Mistral `[TOOL_CALLS]`); scanner.py runs a format over a streamed reply, and
guided.py the constrained reply of `required` / named, so arguments go out as the model writes
them and a call is never malformed.
"""

from kiln.server.tool_calls.parsers import PARSERS, ToolCall, detect_parser, get_parser
from kiln.server.tool_calls.request import ToolPlan, apply_plan, plan_tools
from kiln.server.tool_calls.scanner import CallScanner

__all__ = [
    "PARSERS",
    "CallScanner",
    "ToolCall",
    "ToolPlan",
    "apply_plan",
    "detect_parser",
    "get_parser",
    "plan_tools",
]
