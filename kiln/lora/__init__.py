"""Multi-LoRA serving: PEFT adapters over one base model, batched across adapters.

request.py (the LoRARequest a caller names an adapter with) and slots.py (which adapters hold
the device's slots) are pure Python, for the control plane; peft.py reads an adapter,
layers.py applies the slots' adapters inside the base model's projections, model.py attaches
them to a loaded model and loads adapters into its slots (the data plane)."""

from kiln.lora.request import LoRARequest

__all__ = ["LoRARequest"]
