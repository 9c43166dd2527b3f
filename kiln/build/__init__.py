"""Checkpoint readers: Hugging Face safetensors directories and GGUF files, as HF-named tensors."""

from kiln.build.default_model import default_model_path
from kiln.build.gguf_loader import GGUFModel, load_gguf, load_gguf_tokenizer
from kiln.build.model_config import PRESETS, SUPPORTED_ARCHITECTURES, ModelConfig
from kiln.build.safetensors_loader import load_hf_checkpoint, read_generation_config

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "GGUFModel",
    "ModelConfig",
    "default_model_path",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf_checkpoint",
    "read_generation_config",
]
