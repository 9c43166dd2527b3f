"""Errors a user can act on. Each names the field or file at fault."""


class KilnError(Exception):
    """Base class of every error kiln raises on purpose."""


class InvalidRequestError(KilnError, ValueError):
    """A request parameter or prompt is invalid. `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class ModelLoadError(KilnError):
    """A model could not be found, read or understood (path, architecture, dtype, corrupt file)."""


class BuildError(KilnError):
    """`kiln build` cannot make the engine asked for (a bad output directory, an accuracy check
    the engine fails, a scheme that is not available)."""


class EvalError(KilnError):
    """`kiln eval` cannot run a task: an unknown task name, or its data is missing or malformed."""


class ConfigError(KilnError, ValueError):
    """A setting is invalid (a flag, an EngineConfig field, a speculative config, a model's
    config.json value): the CLI prints it on one line and exits 2."""


class LoRAError(InvalidRequestError):
    """A LoRA adapter cannot be served: missing files, a format or option kiln does not read
    (DoRA, modules_to_save, biases), shapes or a target module the base model does not have, a
    rank over max_lora_rank, an unknown or busy adapter id. One line, naming the adapter. An
    InvalidRequestError (so a ValueError): a request naming such an adapter is refused as any
    invalid request is, and the engine serves the others."""
