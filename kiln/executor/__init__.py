"""Executors: what sits between the engine and the model runner(s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.executor.base import Executor, ExecutorStats, KVCapacity, ModelFacts

if TYPE_CHECKING:
    from kiln.config import EngineConfig

__all__ = ["Executor", "ExecutorStats", "KVCapacity", "ModelFacts", "create_executor"]


def create_executor(config: EngineConfig) -> Executor:
    """One process on one device at tensor_parallel_size = pipeline_parallel_size = 1; otherwise
    one process per rank (multiproc.py). Under torchrun, ranks other than 0 serve as workers here
    until the driver shuts down, then exit: only rank 0 goes on to run the caller's engine."""
    if config.world_size == 1:
        from kiln.executor.in_process import InProcessExecutor

        return InProcessExecutor(config)
    import os

    from kiln.executor.multiproc import MultiprocExecutor, launched_by_torchrun

    if launched_by_torchrun() and int(os.environ["RANK"]) != 0:
        from kiln.executor.worker import run_worker

        run_worker(config, int(os.environ["RANK"]))
        raise SystemExit(0)
    return MultiprocExecutor(config)
