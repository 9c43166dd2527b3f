"""A Responses API request: its body, and its input items as the chat messages the template
renders (function calls as an assistant's tool_calls, their outputs as tool messages)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from kiln.errors import InvalidRequestError
from kiln.server.protocol import INT64, ChatMessage, MessageToolCall, SamplingFields


class ResponsesRequest(SamplingFields):
    """OpenAI's `POST /v1/responses` body (the fields kiln acts on; the rest are accepted and
    ignored, as for chat) and vLLM's sampling extras."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None

    @property
    def response_format(self) -> dict[str, Any] | None:
        """`text.format` as chat's response_format (what structured output reads)."""
        spec = (self.text or {}).get("format")
        if not isinstance(spec, dict) or spec.get("type") != "json_schema":
            return spec if isinstance(spec, dict) else None
        return {"type": "json_schema", "json_schema": {"schema": spec.get("schema")}}


_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


def _text(content: object, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where}.content must be a string or a list", param="input")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                f"{where}.content[{i}] has type {kind!r}: only text parts are supported",
                param="input",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(body: ResponsesRequest) -> list[ChatMessage]:
    """The request's own turns (not the stored conversation it continues)."""
    if isinstance(body.input, str):
        return [ChatMessage(role="user", content=body.input)]
    messages: list[ChatMessage] = []
    for i, item in enumerate(body.input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequestError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequestError(f"{where}.role {role!r} is not valid", param="input")
            messages.append(ChatMessage(role=role, content=_text(item.get("content"), where)))
        elif kind == "function_call":
            call = MessageToolCall.model_validate(
                {
                    "id": item.get("call_id"),
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                }
            )
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant" and last.tool_calls is not None:
                last.tool_calls.append(call)  # parallel calls: one assistant turn
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(output, str):
                output = _text(output, where)
            messages.append(
                ChatMessage(role="tool", content=output, tool_call_id=item.get("call_id"))
            )
        elif kind == "reasoning":
            continue  # templates drop earlier turns' reasoning
        else:
            raise InvalidRequestError(
                f"{where} has type {kind!r}: kiln takes message, function_call, "
                "function_call_output and reasoning items",
                param="input",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools as chat's `{"type": "function", "function": {...}}`."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise InvalidRequestError(
                f"tools[{i}] has type {kind!r}: kiln runs function tools only", param="tools"
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict) and choice.get("type") == "function" and "function" not in choice:
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice
