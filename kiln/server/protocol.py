"""OpenAI request bodies (and the vLLM extras clients send), as pydantic models.

Bounds here are the ones OpenAI documents, plus those that keep a request from hurting the engine
loop (a top-N wider than any sensible vocabulary slice, an n that would flood the scheduler). What
depends on the model (context length, vocabulary) is checked in `params.py` and by the engine.
Unknown fields are ignored, as OpenAI-compatible servers do: clients send vendor extras.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

MAX_N = 128  # OpenAI's own ceiling on n
MAX_LOGPROBS = 20  # OpenAI's ceiling on top_logprobs
MAX_STOP = 16
INT64 = 2**63 - 1

TokenId = Annotated[int, Field(ge=0, le=INT64)]
StopList = Annotated[list[str], Field(max_length=MAX_STOP)]
# Empty prompts are rejected by the server: the schema says so too (schemathesis reads it).
Prompt = (
    Annotated[str, Field(min_length=1)]
    | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """What completions and chat share. None means "the model's default" (generation_config)."""

    model: str | None = None
    n: int | None = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=-INT64 - 1, le=INT64)
    stop: str | StopList | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0, le=INT64)
    priority: int | None = Field(0, ge=-INT64 - 1, le=INT64)
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP)
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    # Structured output (vLLM's extras; OpenAI's response_format is on each body)
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Beam search (vLLM's extras; completions' best_of is the beam width)
    use_beam_search: bool | None = False
    length_penalty: float | None = Field(None, ge=-10.0, le=10.0)
    early_stopping: bool | Literal["never"] | None = None


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=0, le=INT64)
    """0 is allowed only with echo: score the prompt, generate nothing (lm-eval loglikelihood)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool | None = False  # not 0/1: the schema's boolean is what the server takes
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """vLLM's extra: each prompt token's logprob and the top-N, in the choice's prompt_logprobs."""
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: str | None = None
    response_format: dict[str, Any] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class MessageToolCallFunction(_Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; an object is taken too


class MessageToolCall(_Body):
    """An assistant's earlier call, as the API returned it (the chat template reads it)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's result: which call it answers


class ChatCompletionRequest(SamplingFields):
    # top_logprobs needs logprobs=true: the server's 400, said in the schema too.
    model_config = ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {"top_logprobs": {"type": "integer"}},
                "required": ["top_logprobs"],
            },
            "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
        }
    )
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64)
    max_tokens: int | None = Field(None, ge=1, le=INT64)
    """Deprecated by OpenAI in favour of max_completion_tokens; still what most clients send."""
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    """vLLM's extra: the reply continues the last (assistant) message instead of starting one."""
    echo: StrictBool | None = False
    """vLLM's extra: the reply's content starts with the last message's, if that is the
    assistant's (what continue_final_message continues)."""


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter body."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter body (its lora_int_id accepted; the name decides)."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


# ---- responses (documentation of what the handlers return) ------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 503)
}
