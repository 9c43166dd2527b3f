"""The engine's view of the data plane: submit a step, collect its output, ask what fits.

`LLMEngine` holds one Executor and never a model runner. Today's implementation runs one runner
in this process (in_process.py); tensor parallelism adds one that drives a runner per rank and
reports the smallest KV capacity among them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kiln.errors import LoRAError
from kiln.interfaces import EMPTY_RUNNER_OUTPUT, ModelRunnerOutput, SchedulerOutput
from kiln.lora.request import LoRARequest
from kiln.models.config import ModelConfig
from kiln.runtime.memory_plan import MemoryPlan
from kiln.tokenizer import Tokenizer


@dataclass(frozen=True)
class KVCapacity:
    """What the scheduler may hand out: the KV pool and the context every request may reach."""

    num_blocks: int
    block_size: int
    max_model_len: int  # the model's context, capped by the pool


@dataclass(frozen=True)
class ModelFacts:
    """Host-side facts of the loaded model: what the engine needs to tokenize and validate."""

    config: ModelConfig
    tokenizer: Tokenizer | None
    generation_defaults: dict
    description: str
    device: str  # e.g. "cuda:0" or "cpu"
    dtype: str  # e.g. "bfloat16"
    kv_cache_dtype: str  # e.g. "bfloat16" or "float8_e4m3fn"


@dataclass(frozen=True)
class ExecutorStats:
    """For benchmarks and tests: what was planned and captured, and the step timings."""

    memory_plan: MemoryPlan
    cuda_graphs: dict | None  # num_graphs, batch_sizes, capture_s, pool_gib; None when eager
    step_timing: dict | None  # live host/GPU phase totals and a per-step trace, once enabled
    startup: dict | None = None  # seconds: weights loaded, KV cache planned, runner built


class Executor(ABC):
    facts: ModelFacts

    @abstractmethod
    def kv_capacity(self) -> KVCapacity: ...

    @abstractmethod
    def submit(self, step: SchedulerOutput) -> bool:
        """Launch a step; False if it had no tokens (then there is nothing to collect)."""

    @abstractmethod
    def collect(self) -> ModelRunnerOutput:
        """The oldest submitted step's output (waits for it)."""

    def execute(self, step: SchedulerOutput) -> ModelRunnerOutput:
        """One synchronous step."""
        return self.collect() if self.submit(step) else EMPTY_RUNNER_OUTPUT

    @abstractmethod
    def stats(self) -> ExecutorStats: ...

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Read a LoRA adapter into the runner's host memory, checked against the model
        (LoRAError, one line, if it cannot be served)."""
        raise LoRAError("this engine serves no LoRA adapters (start it with enable_lora=True)")

    def remove_lora(self, lora_int_id: int) -> None:
        """Let an adapter's host copy go (its slot is simply no longer named by any step)."""
        raise LoRAError("this engine serves no LoRA adapters (start it with enable_lora=True)")

    @abstractmethod
    def enable_step_timing(self) -> None:
        """Start recording per-step host and GPU times (read them in stats().step_timing)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release workers and devices."""
