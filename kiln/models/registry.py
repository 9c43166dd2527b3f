"""Which model families kiln runs: a Hugging Face architecture class name (config.json's
`architectures`) -> the kiln class that runs it, imported only when a model of that family is
built. A new family is one model file and one line here (docs/adding_a_model.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiln.errors import ModelLoadError

if TYPE_CHECKING:
    from kiln.models.base import CausalLM
    from kiln.models.gguf_names import GGUFLayout


@dataclass(frozen=True)
class Family:
    """One supported architecture."""

    architecture: str
    """kiln's name for it, the Hugging Face `model_type` ("llama", "qwen3", ...)."""
    module: str
    """The module that defines its model class."""
    class_name: str
    """The model class in `module`."""


# HF class name -> its family. Mistral and Qwen2 are Llama's block shape with options.
FAMILIES: dict[str, Family] = {
    "LlamaForCausalLM": Family("llama", "kiln.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": Family("mistral", "kiln.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": Family("qwen2", "kiln.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": Family("qwen3", "kiln.models.qwen3", "Qwen3ForCausalLM"),
    "GemmaForCausalLM": Family("gemma", "kiln.models.gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": Family("gemma2", "kiln.models.gemma2", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": Family("gemma3_text", "kiln.models.gemma3", "Gemma3ForCausalLM"),
    "Phi3ForCausalLM": Family("phi3", "kiln.models.phi3", "Phi3ForCausalLM"),
    "GraniteForCausalLM": Family("granite", "kiln.models.granite", "GraniteForCausalLM"),
    "Olmo2ForCausalLM": Family("olmo2", "kiln.models.olmo2", "Olmo2ForCausalLM"),
    "StableLmForCausalLM": Family("stablelm", "kiln.models.stablelm", "StableLmForCausalLM"),
    "CohereForCausalLM": Family("cohere", "kiln.models.cohere", "CohereForCausalLM"),
    "MixtralForCausalLM": Family("mixtral", "kiln.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": Family("qwen2_moe", "kiln.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": Family("qwen3_moe", "kiln.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "Glm4MoeForCausalLM": Family("glm4_moe", "kiln.models.glm4_moe", "Glm4MoeForCausalLM"),
    "DeepseekV3ForCausalLM": Family("deepseek_v3", "kiln.models.deepseek", "DeepseekV3ForCausalLM"),
    "DeepseekV2ForCausalLM": Family("deepseek_v2", "kiln.models.deepseek", "DeepseekV2ForCausalLM"),
    "GptOssForCausalLM": Family("gpt_oss", "kiln.models.gpt_oss", "GptOssForCausalLM"),
    "Starcoder2ForCausalLM": Family(
        "starcoder2", "kiln.models.starcoder2", "Starcoder2ForCausalLM"
    ),
}

# llama.cpp's `general.architecture` -> (module, name of its GGUFLayout). Mistral 7B GGUFs are
# written as "llama".
GGUF_LAYOUTS: dict[str, tuple[str, str]] = {
    "llama": ("kiln.models.llama", "LLAMA_GGUF"),
    "qwen2": ("kiln.models.llama", "QWEN2_GGUF"),
    "qwen3": ("kiln.models.qwen3", "QWEN3_GGUF"),
    "gemma": ("kiln.models.gemma", "GEMMA_GGUF"),
    "gemma2": ("kiln.models.gemma2", "GEMMA2_GGUF"),
    "gemma3": ("kiln.models.gemma3", "GEMMA3_GGUF"),
    "starcoder2": ("kiln.models.starcoder2", "STARCODER2_GGUF"),
    "phi3": ("kiln.models.phi3", "PHI3_GGUF"),
}

_BY_ARCHITECTURE = {family.architecture: (cls, family) for cls, family in FAMILIES.items()}


def supported_names() -> str:
    """ "LlamaForCausalLM (llama), ..." for error messages."""
    return ", ".join(f"{cls} ({family.architecture})" for cls, family in FAMILIES.items())


def is_supported(architecture: str) -> bool:
    return architecture in _BY_ARCHITECTURE


def architecture_of_class(hf_class: str) -> str | None:
    """kiln's architecture name for an HF class name, or None if kiln does not run it."""
    family = FAMILIES.get(hf_class)
    return None if family is None else family.architecture


def hf_class_of(architecture: str) -> str:
    """The HF class name config.json gives a model of `architecture`."""
    return _family(architecture)[0]


def model_class(architecture: str) -> type[CausalLM]:
    """The kiln model class of `architecture` (its module imported now)."""
    family = _family(architecture)[1]
    return getattr(importlib.import_module(family.module), family.class_name)


def gguf_layout(gguf_architecture: str, where: str) -> GGUFLayout:
    """How a GGUF file of llama.cpp's `gguf_architecture` names its tensors (see gguf_names)."""
    found = GGUF_LAYOUTS.get(gguf_architecture)
    if found is None:
        raise ModelLoadError(
            f"{where}: unsupported GGUF architecture {gguf_architecture!r}; "
            f"supported: {', '.join(GGUF_LAYOUTS)}"
        )
    module, name = found
    return getattr(importlib.import_module(module), name)


def _family(architecture: str) -> tuple[str, Family]:
    found = _BY_ARCHITECTURE.get(architecture)
    if found is None:
        raise ModelLoadError(
            f"unsupported architecture {architecture!r}; supported: {supported_names()}"
        )
    return found
