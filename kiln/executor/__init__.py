"""Executors: what sits between the engine and the model runner(s)."""

from kiln.executor.base import Executor, ExecutorStats, KVCapacity, ModelFacts

__all__ = ["Executor", "ExecutorStats", "KVCapacity", "ModelFacts", "create_executor"]


def create_executor(config: object) -> Executor:
    """The executor for an EngineConfig (one process, one device: the only kind today)."""
    from kiln.executor.in_process import InProcessExecutor

    return InProcessExecutor(config)
