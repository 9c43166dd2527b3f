"""Checkpoint readers: Hugging Face safetensors directories and GGUF files, as HF-named tensors.

Names are imported on first use (PEP 562), so loading an HF checkpoint or a preset never imports
the `gguf` package (absent on some GPU images), nor safetensors for a GGUF file.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "default_model_path": "kiln.checkpoint.default_model",
    "GGUFModel": "kiln.checkpoint.gguf_loader",
    "load_gguf": "kiln.checkpoint.gguf_loader",
    "load_gguf_tokenizer": "kiln.checkpoint.gguf_loader",
    "load_hf_checkpoint": "kiln.checkpoint.safetensors_loader",
    "read_generation_config": "kiln.checkpoint.safetensors_loader",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> object:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kiln.checkpoint' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
