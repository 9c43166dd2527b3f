"""Tensor/pipeline parallel on one machine or several: this process is the driver, global rank 0
(tensor rank 0 of the last pipeline stage, so it samples); the other ranks are worker processes.

Each step the driver broadcasts the SchedulerOutput (messages.py: typed JSON over gloo) and runs
its own rank; the ranks meet in the layers' collectives; the driver samples and broadcasts the
ids, and its runner's output is the step's output.

Launch: kiln starts the workers itself (`python -m kiln.executor.worker`, a tcp:// rendezvous on
127.0.0.1), or, under torchrun (RANK/WORLD_SIZE in the environment; several machines with
--nnodes and --rdzv-endpoint), every rank is already running: rank 0 drives, the others become
workers in create_executor.

Failure: a thread watches the workers it started; when one exits, the others are killed (no
orphan is left blocked in a collective) and the driver's next (or current) step raises
RankFailedError naming the rank and its exit code. A rank that hangs ends the step when the
process group's timeout (distributed_timeout_s) fires. Workers die with the driver (PDEATHSIG).
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time

from kiln.config import EngineConfig
from kiln.distributed.parallel_state import destroy_process_groups, init_process_groups
from kiln.errors import KilnError
from kiln.executor.base import Executor, ExecutorStats, KVCapacity
from kiln.executor.in_process import runner_stats
from kiln.executor.messages import Kind, encode_step, send_message
from kiln.executor.rank import build_rank
from kiln.executor.worker import data_backend_for
from kiln.interfaces import ModelRunnerOutput, SchedulerOutput
from kiln.lora.request import LoRARequest

logger = logging.getLogger("kiln")


class RankFailedError(KilnError):
    """A rank of a tensor/pipeline-parallel engine died or stopped answering."""


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or (
        "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._timeout = config.distributed_timeout_s
        self._procs: dict[int, subprocess.Popen] = {}
        self._failure: str | None = None
        self._closed = False
        init_method = "env://"
        if launched_by_torchrun():
            world = int(os.environ["WORLD_SIZE"])
            if world != config.world_size:
                raise RankFailedError(
                    f"torchrun started {world} processes; tensor_parallel_size x "
                    f"pipeline_parallel_size is {config.world_size}"
                )
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
            self._start_workers(init_method)
        atexit.register(self.shutdown)
        try:
            self.parallel = init_process_groups(
                config.tensor_parallel_size,
                config.pipeline_parallel_size,
                0,
                data_backend_for(config),
                config.distributed_timeout_s,
                init_method,
                config.enable_expert_parallel,
            )
            rank = build_rank(config, self.parallel)
        except KilnError:  # this rank's own error (a model that does not split, a bad path):
            self._closed = True  # every rank hits it; it says more than a worker's exit code
            self._kill_workers()
            raise
        except Exception as exc:
            raise self._failed(exc) from exc
        self.facts, self.memory_plan, self.runner = rank.facts, rank.memory_plan, rank.runner
        self._capacity = rank.capacity
        logger.info(
            "%d ranks (tensor %d x pipeline %d) on %s",
            config.world_size,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            self.facts.device,
        )

    # ---- workers -----------------------------------------------------------------------------

    def _start_workers(self, init_method: str) -> None:
        env_config = json.dumps(dataclasses.asdict(self.config))
        for rank in range(1, self.config.world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.config.world_size),
                "KILN_WORKER_INIT_METHOD": init_method,
                "KILN_WORKER_CONFIG": env_config,
            }
            cmd = [sys.executable, "-m", "kiln.executor.worker"]
            self._procs[rank] = subprocess.Popen(cmd, env=env)
        threading.Thread(target=self._watch, daemon=True, name="kiln-rank-watch").start()

    def _watch(self) -> None:
        while not self._closed and self._failure is None:
            for rank, proc in self._procs.items():
                code = proc.poll()
                if code is not None and not self._closed:
                    self._failure = f"rank {rank} (pid {proc.pid}) exited with code {code}"
                    logger.error("%s: stopping the engine", self._failure)
                    self._kill_workers()
                    return
            time.sleep(0.1)

    def _kill_workers(self) -> None:
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                logger.error("rank pid %d did not exit after SIGKILL", proc.pid)

    def _failed(self, exc: BaseException) -> RankFailedError:
        """The error for a step or startup that raised: it names the dead rank when one died
        (the watcher may see the exit a moment after the collective failed)."""
        deadline = time.monotonic() + 2.0
        while self._failure is None and self._procs and time.monotonic() < deadline:
            time.sleep(0.05)
        if self._failure is None:
            self._failure = f"a rank failed ({type(exc).__name__}: {exc})"
        self._kill_workers()  # (again: the watcher may still be at it) none outlives the engine
        return RankFailedError(f"tensor/pipeline-parallel engine stopped: {self._failure}")

    def _check(self) -> None:
        if self._failure is not None:
            raise RankFailedError(f"tensor/pipeline-parallel engine stopped: {self._failure}")
        if self._closed:
            raise RankFailedError("the tensor/pipeline-parallel engine was shut down")

    # ---- Executor ----------------------------------------------------------------------------

    def kv_capacity(self) -> KVCapacity:
        return self._capacity

    def submit(self, step: SchedulerOutput) -> bool:
        self._check()
        try:
            send_message(self.parallel, Kind.STEP, encode_step(step), self._timeout)
            return self.runner.submit(step)
        except RuntimeError as exc:  # a collective that failed: a peer died or timed out
            raise self._failed(exc) from exc

    def collect(self) -> ModelRunnerOutput:
        self._check()
        try:
            return self.runner.collect()
        except RuntimeError as exc:
            raise self._failed(exc) from exc

    def add_lora(self, lora_request: LoRARequest) -> None:
        """The driver reads and checks the adapter first (a bad one is refused here, no rank
        having taken it); then every other rank reads its own cut."""
        self._check()
        if self.runner.lora is None:
            super().add_lora(lora_request)
            return
        self.runner.lora.add_adapter(lora_request)
        body = json.dumps(dataclasses.asdict(lora_request)).encode()
        send_message(self.parallel, Kind.ADD_LORA, body, self._timeout)

    def remove_lora(self, lora_int_id: int) -> None:
        self._check()
        if self.runner.lora is None:
            super().remove_lora(lora_int_id)
            return
        self.runner.lora.remove_adapter(lora_int_id)
        body = json.dumps({"lora_int_id": lora_int_id}).encode()
        send_message(self.parallel, Kind.REMOVE_LORA, body, self._timeout)

    def enable_step_timing(self) -> None:
        self._check()
        send_message(self.parallel, Kind.ENABLE_TIMING, b"", self._timeout)
        self.runner.step_timing = {}

    def stats(self) -> ExecutorStats:
        return runner_stats(self.memory_plan, self.runner)  # the driver's rank

    def shutdown(self) -> None:
        if self._closed:
            return
        healthy = self._failure is None and hasattr(self, "parallel")
        self._closed = True
        if healthy:
            with contextlib.suppress(RuntimeError):
                send_message(self.parallel, Kind.SHUTDOWN, b"", 10.0)
        for proc in self._procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._kill_workers()
        if hasattr(self, "parallel"):  # this engine made the group (not a refused second one)
            with contextlib.suppress(Exception):  # a group broken by a dead rank still goes
                destroy_process_groups()
