"""A chat request's tools and tool_choice -> what to render, constrain and parse."""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, replace
from typing import Any

from kiln.errors import InvalidRequestError
from kiln.sampling_params import GuidedDecodingParams, SamplingParams
from kiln.server.tool_calls.guided import GuidedCallScanner
from kiln.server.tool_calls.parsers import ToolCall, ToolCallParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto", "required" or "named"
    tools: list[dict[str, Any]]  # OpenAI's tool objects, as the chat template takes them
    parser: ToolCallParser | None  # auto: the model's own format
    guided: GuidedDecodingParams | None  # required / named: the grammar of the call
    function_name: str | None = None  # named
    parallel: bool = True

    def message(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The reply's content and tool calls from its whole text."""
        if self.mode != "auto":  # the streaming scanner, fed the whole reply
            scanner = self.guided_scanner()
            content, calls = events_message(scanner.feed(text) + scanner.finish())
        else:
            assert self.parser is not None  # auto: plan_tools gives the model's parser
            content, calls = self.parser.parse(text)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def guided_scanner(self) -> GuidedCallScanner:
        """required / named: the scanner of the constrained reply."""
        return GuidedCallScanner(self.mode, self.function_name)


def events_message(events: list[tuple[str, str]]) -> tuple[str | None, list[ToolCall]]:
    """A scanner's events gathered: (content or None, calls)."""
    content = "".join(v for k, v in events if k == "content")
    calls: list[list[str]] = []
    for kind, value in events:
        if kind == "call":
            calls.append([value, ""])
        elif kind == "args":
            calls[-1][1] += value
    return content or None, [ToolCall(name, arguments) for name, arguments in calls]


def apply_plan(plan: ToolPlan | None, params: SamplingParams) -> SamplingParams:
    """The sampling params a plan needs: the call's grammar (required / named). `auto` changes
    nothing: Hermes' <tool_call> is not a special token in the tokenizers that use it, and
    Llama 3.1's special <|python_tag|> is optional to its parser."""
    if plan is not None and plan.parser is not None and plan.parser.needs_special_tokens:
        params = replace(params, skip_special_tokens=False)  # the call's marker is one
    if plan is None or plan.guided is None:
        return params
    if params.guided_decoding is not None:
        raise InvalidRequestError(
            f"tool_choice {plan.mode!r} already constrains the reply: drop response_format",
            param="tool_choice",
        )
    return replace(params, guided_decoding=plan.guided)


def plan_tools(
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
    parser: ToolCallParser,
) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice "none")."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    by_name = {f["name"]: f for f in functions}
    choice = "auto" if tool_choice is None else tool_choice
    parallel = parallel_tool_calls is not False
    if choice == "none":
        return None
    if choice == "auto":
        return ToolPlan("auto", tools, parser, None, parallel=parallel)
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [f["name"]]},
                    "parameters": f.get("parameters") or EMPTY_PARAMETERS,
                },
                "required": ["name", "parameters"],
            }
            for f in functions
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        if not parallel:
            schema["maxItems"] = 1
        guided = GuidedDecodingParams(json=schema)
        return ToolPlan("required", tools, None, guided, parallel=parallel)
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name")
        if choice.get("type") != "function" or not isinstance(name, str):
            raise InvalidRequestError(
                'a named tool_choice is {"type": "function", "function": {"name": ...}}',
                param="tool_choice",
            )
        if name not in by_name:
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
            )
        parameters = by_name[name].get("parameters") or EMPTY_PARAMETERS
        return ToolPlan(
            "named", tools, None, GuidedDecodingParams(json=parameters), function_name=name
        )
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or a named function',
        param="tool_choice",
    )


def _function(tool: dict[str, Any], index: int) -> dict[str, Any]:
    function = tool.get("function") if isinstance(tool, dict) else None
    if tool.get("type") != "function" or not isinstance(function, dict):
        raise InvalidRequestError(
            f'tools[{index}] must be {{"type": "function", "function": {{...}}}}', param="tools"
        )
    if not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"tools[{index}].function needs a name", param="tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(
            f"tools[{index}].function.parameters must be a JSON schema object", param="tools"
        )
    return function


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's earlier call as templates read it: arguments as an object when they parse
    (Qwen2.5's and Llama 3.1's templates apply `tojson` to them)."""
    function = dict(call["function"])  # the request schema requires it (MessageToolCall)
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}
