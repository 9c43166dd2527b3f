"""Token sampling: `Sampler` turns a step's logits into tokens; `compute_logprobs` serves prompt
logprobs too."""

from kiln.sampling.sampler import (
    LogprobsTensors,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    apply_penalties,
    compute_logprobs,
)

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "apply_penalties",
    "compute_logprobs",
]
