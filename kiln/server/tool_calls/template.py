"""Whether a model's chat template shows tools to the model: `tools` with tool_choice "auto"
on one that does not would be accepted and never seen (the model cannot call what it was not
shown), so the request is refused instead, as vLLM's `--enable-auto-tool-choice` contract
makes explicit."""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidRequestError

_PROBE_NAME = "kiln_probe_tool_4f1c"
_PROBE = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}
_SHOWS_TOOLS: dict[str, bool] = {}  # by the template's text: rendered once per template


def template_shows_tools(tokenizer: Any) -> bool:
    """Render a probe tool through the template once and look for its name in the text. A
    template that fails on the probe is given the benefit of the doubt: the request's own
    rendering then reports its error."""
    key = repr(getattr(tokenizer, "chat_template", None))
    if key not in _SHOWS_TOOLS:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": "hi"}],
                tools=[_PROBE],
                tokenize=False,
                add_generation_prompt=True,
            )
            _SHOWS_TOOLS[key] = _PROBE_NAME in text
        except Exception:  # the template's own failure is the request's to report
            _SHOWS_TOOLS[key] = True
    return _SHOWS_TOOLS[key]


def check_auto_tools_shown(tokenizer: Any, model_name: str) -> None:
    """A 400 naming the template when tool_choice "auto" would hide the tools from the model."""
    if not template_shows_tools(tokenizer):
        raise InvalidRequestError(
            f'tools with tool_choice "auto": the chat template of {model_name} does not show '
            'tools to the model, so it would never call one; send tool_choice "required" or '
            "a named function (kiln constrains the reply to a call), or serve a model whose "
            "template renders tools",
            param="tools",
        )
