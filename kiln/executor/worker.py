"""A rank other than the driver: build this rank's part of the model, then run every step the
driver broadcasts, until it says shut down.

Started by kiln's own launcher (multiproc.py: `python -m kiln.executor.worker`, the engine config
as JSON in KILN_WORKER_CONFIG) or, under torchrun, called by create_executor on ranks != 0.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING

from kiln.config import EngineConfig
from kiln.distributed.parallel_state import (
    destroy_process_groups,
    init_process_groups,
)
from kiln.executor.messages import Kind, decode_step, recv_message
from kiln.lora.request import LoRARequest

if TYPE_CHECKING:
    from kiln.runtime.model_runner import ModelRunner

logger = logging.getLogger("kiln")


def data_backend_for(config: EngineConfig) -> str:
    from kiln.runtime.model_loader import resolve_device

    return "nccl" if resolve_device(config.device).type == "cuda" else "gloo"


def run_worker(config: EngineConfig, rank: int, init_method: str = "env://") -> None:
    from kiln.executor.rank import build_rank

    parallel = init_process_groups(
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        rank,
        data_backend_for(config),
        config.distributed_timeout_s,
        init_method,
        config.enable_expert_parallel,
    )
    runner = build_rank(config, parallel).runner
    # Steps left uncollected after a submit: under pipeline parallelism one fewer than the stages,
    # so this rank takes the next micro-batch's message (and runs its forward) before the driver
    # has sampled the current one. A request comes back at the earliest pp steps later (the
    # scheduler does not schedule it while its token is in flight), by which time its step has
    # been collected here, so its input token is in this rank's history.
    keep_uncollected = parallel.pp_size - 1
    num_uncollected = 0
    while True:
        kind, payload = recv_message(parallel)
        if kind is Kind.SHUTDOWN:
            break
        if kind is Kind.ENABLE_TIMING:
            runner.step_timing = {}
            continue
        if kind in (Kind.ADD_LORA, Kind.REMOVE_LORA):
            apply_lora_message(runner, kind, payload)
            continue
        if runner.submit(decode_step(payload)):
            num_uncollected += 1
        while num_uncollected > keep_uncollected:
            runner.collect()  # this rank's copy of the output: the driver's is the one read
            num_uncollected -= 1
    destroy_process_groups()


def apply_lora_message(runner: ModelRunner, kind: Kind, payload: bytes) -> None:
    """An adapter the driver read (so checked) already: this rank reads its own cut of it."""
    assert runner.lora is not None  # the driver sends these only with enable_lora
    body = json.loads(payload)
    if kind is Kind.ADD_LORA:
        runner.lora.add_adapter(LoRARequest(**body))
    else:
        runner.lora.remove_adapter(body["lora_int_id"])


def die_with_parent() -> None:
    """Never outlive the driver: the kernel kills this process when its parent exits (Linux), and
    a watcher thread exits it where that is not available."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="kiln-parent-watch").start()


def main() -> None:
    from kiln.envs import envs

    die_with_parent()
    logging.basicConfig(level=logging.WARNING)
    worker_config = envs().worker_config
    if worker_config is None:
        raise SystemExit("kiln.executor.worker is started by kiln itself (KILN_WORKER_CONFIG)")
    config = EngineConfig(**json.loads(worker_config))
    try:
        run_worker(config, int(os.environ["RANK"]), envs().worker_init_method or "env://")
    except Exception as exc:  # the driver names the rank and this line
        print(f"kiln rank {os.environ['RANK']}: {type(exc).__name__}: {exc}", file=sys.stderr)
        raise SystemExit(1) from exc
    # Done: skip the interpreter's teardown (seconds of module finalisers on a busy host).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
