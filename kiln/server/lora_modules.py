"""`kiln serve --lora-modules`: the adapters a server starts with, in vLLM's two spellings
(`name=path`, or a JSON object `{"name": ..., "path": ..., "base_model_name": ...}`)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from kiln.errors import ConfigError


@dataclass(frozen=True)
class LoRAModule:
    """One adapter the server serves under `name` (a request's `model`)."""

    name: str
    path: str
    base_model_name: str | None = None  # /v1/models' `parent` (None: the served model's name)


def parse_lora_module(text: str) -> LoRAModule:
    """One `--lora-modules` item: `name=path` or vLLM's JSON object form."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--lora-modules {text}: not JSON ({exc})") from None
        if not isinstance(value, dict) or set(value) - {"name", "path", "base_model_name"}:
            raise ConfigError(
                f"--lora-modules {text}: a JSON item has the keys name, path and, optionally, "
                "base_model_name"
            )
        name, path, base = value.get("name"), value.get("path"), value.get("base_model_name")
        if not isinstance(base, str | None):
            raise ConfigError(f"--lora-modules {text}: base_model_name must be a string")
    else:
        name, sep, path = text.partition("=")
        base = None
        if not sep:
            raise ConfigError(f"--lora-modules {text}: give name=path (or a JSON object)")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"--lora-modules {text}: the adapter's name is empty")
    if not isinstance(path, str) or not path.strip():
        raise ConfigError(f"--lora-modules {text}: the adapter's path is empty")
    return LoRAModule(name.strip(), path.strip(), base)


def parse_lora_modules(items: list[str] | None, served_model_name: str) -> tuple[LoRAModule, ...]:
    """Every `--lora-modules` item; a name given twice, or the base model's own, is an error."""
    modules = tuple(parse_lora_module(item) for item in items or ())
    seen: set[str] = set()
    for module in modules:
        if module.name == served_model_name:
            raise ConfigError(
                f"--lora-modules {module.name}: that is the base model's name; give the adapter "
                "another"
            )
        if module.name in seen:
            raise ConfigError(f"--lora-modules: the name {module.name!r} is given twice")
        seen.add(module.name)
    return modules
