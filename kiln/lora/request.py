"""The name a request gives its adapter: vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.errors import LoRAError


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) under a
    name and an integer id. The id is what the engine keys the adapter by (its device slot, its
    prefix-cache entries); the name is what a server lists and a request's `model` names."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # vLLM's field, kept for its callers; kiln ignores it

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise LoRAError(
                f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}"
            )
        if not self.lora_name:
            raise LoRAError("LoRARequest.lora_name must not be empty")

    @property
    def adapter_id(self) -> int:
        """vLLM's alias of lora_int_id."""
        return self.lora_int_id

    @property
    def name(self) -> str:
        """vLLM's alias of lora_name."""
        return self.lora_name

    @property
    def path(self) -> str:
        """vLLM's alias of lora_path."""
        return self.lora_path
