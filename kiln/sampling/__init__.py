"""Token sampling: `Sampler` turns a step's logits into tokens (penalties, then the logits
processors, then greedy or random choice); `compute_logprobs` serves prompt logprobs too."""

from kiln.sampling.logits_processors import LogitsProcessor, MinTokensProcessor
from kiln.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_penalties,
    compute_logprobs,
)

__all__ = [
    "LogitsProcessor",
    "LogprobsTensors",
    "MinTokensProcessor",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties",
    "compute_logprobs",
]
