"""One model runner in this process, on one device: load, plan the KV cache, run steps."""

from __future__ import annotations

from kiln.config import EngineConfig
from kiln.errors import LoRAError
from kiln.executor.base import Executor, ExecutorStats, KVCapacity
from kiln.executor.rank import build_rank
from kiln.interfaces import ModelRunnerOutput, SchedulerOutput
from kiln.lora.request import LoRARequest
from kiln.runtime.memory_plan import MemoryPlan
from kiln.runtime.model_runner import ModelRunner


class InProcessExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        rank = build_rank(config)
        self.facts, self.memory_plan, self.runner = rank.facts, rank.memory_plan, rank.runner
        self._capacity = rank.capacity
        self._startup = rank.startup

    def kv_capacity(self) -> KVCapacity:
        return self._capacity

    def submit(self, step: SchedulerOutput) -> bool:
        return self.runner.submit(step)

    def collect(self) -> ModelRunnerOutput:
        return self.runner.collect()

    def enable_step_timing(self) -> None:
        self.runner.step_timing = {}

    def add_lora(self, lora_request: LoRARequest) -> None:
        if self.runner.lora is None:
            super().add_lora(lora_request)
        else:
            self.runner.lora.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> None:
        if self.runner.lora is None:
            raise LoRAError("this engine serves no LoRA adapters (start it with enable_lora=True)")
        self.runner.lora.remove_adapter(lora_int_id)

    def shutdown(self) -> None:
        pass  # the runner's tensors go with the executor

    def stats(self) -> ExecutorStats:
        return runner_stats(self.memory_plan, self.runner, self._startup)


def runner_stats(
    memory_plan: MemoryPlan, runner: ModelRunner, startup: dict | None = None
) -> ExecutorStats:
    graphs = runner.graphs
    cuda_graphs = None
    if graphs is not None:
        cuda_graphs = {
            "num_graphs": graphs.num_graphs,
            "batch_sizes": graphs.batch_sizes,
            "capture_s": graphs.capture_seconds,
            "warmup_s": graphs.warmup_seconds,
            "record_s": graphs.record_seconds,
            "pool_gib": graphs.pool_bytes / 2**30,
        }
    return ExecutorStats(memory_plan, cuda_graphs, runner.step_timing, startup)
