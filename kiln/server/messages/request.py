"""An Anthropic Messages API request: its body, and its content blocks as the chat messages the
template renders (tool_use blocks as an assistant's tool_calls, tool_result blocks as tool
messages), its tools and tool_choice as chat's."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiln.errors import InvalidRequestError
from kiln.server.protocol import INT64, ChatMessage, MessageToolCall, SamplingFields, StopList


class AnthropicMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class MessagesRequest(SamplingFields):
    """Anthropic's `POST /v1/messages` body, and vLLM's sampling extras."""

    max_tokens: int = Field(ge=1, le=INT64)
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    stop_sequences: StopList | None = None
    metadata: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # a reasoning parser splits what the model thinks


def _blocks(content: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "text", "text": content}] if isinstance(content, str) else content


def _block_text(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequestError(f"{where} must be a string or a list", param="messages")
    return "\n".join(_text_of(block, f"{where}[{i}]") for i, block in enumerate(content))


def _text_of(block: object, where: str) -> str:
    if not isinstance(block, dict) or block.get("type") != "text":
        kind = block.get("type") if isinstance(block, dict) else None
        raise InvalidRequestError(
            f"{where} has type {kind!r}: kiln takes text, tool_use and tool_result blocks",
            param="messages",
        )
    text = block.get("text")
    if not isinstance(text, str):
        raise InvalidRequestError(f"{where}.text must be a string", param="messages")
    return text


def chat_messages(body: MessagesRequest) -> list[ChatMessage]:
    """The system prompt, then each message's blocks as chat turns."""
    out: list[ChatMessage] = []
    if body.system:
        out.append(ChatMessage(role="system", content=_block_text(body.system, "system")))
    for i, message in enumerate(body.messages):
        texts: list[str] = []
        calls: list[MessageToolCall] = []
        for j, block in enumerate(_blocks(message.content)):
            where = f"messages[{i}].content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_result" and message.role == "user":
                content = _block_text(block.get("content"), where + ".content")
                out.append(
                    ChatMessage(role="tool", content=content, tool_call_id=block.get("tool_use_id"))
                )
            elif kind == "tool_use" and message.role == "assistant":
                arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
                calls.append(
                    MessageToolCall.model_validate(
                        {
                            "id": block.get("id"),
                            "function": {"name": block.get("name"), "arguments": arguments},
                        }
                    )
                )
            elif kind in ("thinking", "redacted_thinking") and message.role == "assistant":
                continue  # templates drop earlier turns' reasoning
            else:
                texts.append(_text_of(block, where))
        if texts or calls:
            out.append(
                ChatMessage(role=message.role, content="\n".join(texts), tool_calls=calls or None)
            )
    return out


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's tools (name, description, input_schema) as chat's function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or not isinstance(tool.get("name"), str):
            raise InvalidRequestError(f"tools[{i}] needs a name", param="tools")
        if tool.get("type") not in (None, "custom"):
            raise InvalidRequestError(
                f"tools[{i}] has type {tool['type']!r}: kiln runs client tools only",
                param="tools",
            )
        function = {"name": tool["name"], "parameters": tool.get("input_schema")}
        if tool.get("description"):
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[str | dict[str, Any] | None, bool]:
    """(chat's tool_choice, parallel calls allowed)."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}, parallel
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
    if mapped is None:
        raise InvalidRequestError(
            'tool_choice type must be "auto", "any", "tool" or "none"', param="tool_choice"
        )
    return mapped, parallel


class CountTokensRequest(MessagesRequest):
    """count_tokens takes a message body without max_tokens."""

    max_tokens: int | None = Field(None, ge=1, le=INT64)  # type: ignore[assignment]
