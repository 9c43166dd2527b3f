"""kiln: an LLM inference engine with in-flight batching over a paged KV cache."""

from kiln.config import EngineConfig
from kiln.errors import InvalidRequestError, KilnError, LoRAError, ModelLoadError
from kiln.lora.request import LoRARequest
from kiln.outputs import CompletionOutput, Logprob, RequestOutput
from kiln.sampling_params import GuidedDecodingParams, SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # LLM pulls in torch and transformers: import it lazily so `import kiln` stays cheap.
    if name == "LLM":
        from kiln.llm import LLM

        return LLM
    raise AttributeError(f"module 'kiln' has no attribute {name!r}")


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineConfig",
    "GuidedDecodingParams",
    "InvalidRequestError",
    "KilnError",
    "LoRAError",
    "LoRARequest",
    "Logprob",
    "ModelLoadError",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
