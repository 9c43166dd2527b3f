"""OpenAI's `response_format` and vLLM's `guided_*` extras -> GuidedDecodingParams.

Shape errors are a 400 naming the field here; whether the schema, regex or grammar compiles is
checked by the engine (kiln/structured_output), which names the problem in its 400.
"""

from __future__ import annotations

from typing import Any

from kiln.errors import InvalidRequestError
from kiln.sampling_params import GuidedDecodingParams


def guided_decoding_params(req: Any) -> GuidedDecodingParams | None:
    """From a chat or completion body: response_format, guided_json, guided_regex, guided_choice,
    guided_grammar (at most one of them)."""
    given: dict[str, GuidedDecodingParams] = {}
    response_format = getattr(req, "response_format", None)
    if response_format is not None:
        spec = _response_format(response_format)
        if spec is not None:
            given["response_format"] = spec
    for field, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, field, None)
        if value is None:
            continue
        if kind == "json" and isinstance(value, str):
            value = _parse_json(value, field)
        if kind == "json" and not isinstance(value, dict):
            raise InvalidRequestError(f"{field} must be a JSON schema object", param=field)
        given[field] = _guided(field, **{kind: value})
    if len(given) > 1:
        raise InvalidRequestError(
            f"give one of {', '.join(sorted(given))}, not several", param=sorted(given)[0]
        )
    return next(iter(given.values()), None)


def _response_format(value: dict[str, Any]) -> GuidedDecodingParams | None:
    kind = value.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedDecodingParams(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise InvalidRequestError(
                'response_format of type "json_schema" needs a json_schema object',
                param="response_format.json_schema",
            )
        schema = spec.get("schema", spec.get("json_schema"))
        if schema is None:
            # OpenAI allows leaving it out: any JSON object, then.
            return GuidedDecodingParams(json_object=True)
        if isinstance(schema, str):
            schema = _parse_json(schema, "response_format.json_schema.schema")
        if not isinstance(schema, dict):
            raise InvalidRequestError(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format.json_schema.schema",
            )
        return GuidedDecodingParams(json=schema)
    raise InvalidRequestError(
        f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
        param="response_format",
    )


def _guided(field: str, **kwargs: Any) -> GuidedDecodingParams:
    try:
        return GuidedDecodingParams(**kwargs)
    except InvalidRequestError as exc:
        raise InvalidRequestError(str(exc), param=field) from exc


def _parse_json(text: str, field: str) -> Any:
    import json

    try:
        return json.loads(text)
    except ValueError as exc:
        raise InvalidRequestError(f"{field} is not valid JSON: {exc}", param=field) from exc
