"""The driver's per-step message to the other ranks: a SchedulerOutput as JSON bytes, broadcast
over the gloo control group (a header of two int64s, then the bytes as uint8; no timeout: workers
wait there while the engine is idle).

JSON of plain dataclasses, never pickle: a rank decodes data, it runs no code it is sent."""

from __future__ import annotations

import dataclasses
import datetime
import json
from enum import IntEnum

import torch
import torch.distributed as dist

from kiln.distributed.parallel_state import ParallelContext
from kiln.interfaces import CachedRequestData, NewRequestData, SchedulerOutput
from kiln.sampling_params import SamplingParams


class Kind(IntEnum):
    STEP = 1
    ENABLE_TIMING = 2
    SHUTDOWN = 3
    ADD_LORA = 4  # JSON {lora_name, lora_int_id, lora_path}: read it into host memory
    REMOVE_LORA = 5  # JSON {lora_int_id}


def encode_step(step: SchedulerOutput) -> bytes:
    def params(p: SamplingParams) -> dict:
        return {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.init}

    new = []
    for r in step.new_requests:
        fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
        new.append({**fields, "sampling_params": params(r.sampling_params)})
    body = {
        "new": new,
        "cached": [dataclasses.asdict(c) for c in step.cached_requests],
        "scheduled": step.num_scheduled_tokens,
        "total": step.total_num_scheduled_tokens,
        "finished": sorted(step.finished_req_ids),
        "preempted": step.num_preempted,
        "step_id": step.step_id,
        "copies": step.block_copies,
        "loras": step.lora_loads,
    }
    return json.dumps(body, separators=(",", ":")).encode()


def decode_step(data: bytes) -> SchedulerOutput:
    body = json.loads(data)
    new = [
        NewRequestData(**{**r, "sampling_params": SamplingParams(**r["sampling_params"])})
        for r in body["new"]
    ]
    return SchedulerOutput(
        new_requests=new,
        cached_requests=[CachedRequestData(**c) for c in body["cached"]],
        num_scheduled_tokens=body["scheduled"],
        total_num_scheduled_tokens=body["total"],
        finished_req_ids=frozenset(body["finished"]),
        num_preempted=body["preempted"],
        step_id=body["step_id"],
        block_copies=[tuple(c) for c in body["copies"]],
        lora_loads=[tuple(x) for x in body["loras"]],
    )


def send_message(ctx: ParallelContext, kind: Kind, payload: bytes, timeout_s: float) -> None:
    """From the driver (rank 0) to every other rank. A gloo broadcast's root waits until every
    receiver takes it, so the driver bounds that wait by the step timeout: a stopped worker ends
    the step with an error, while the workers' side waits without limit."""
    timeout = datetime.timedelta(seconds=timeout_s)
    header = torch.tensor([int(kind), len(payload)])
    dist.broadcast(header, src=0, group=ctx.control_group, async_op=True).wait(timeout)
    if payload:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        dist.broadcast(data, src=0, group=ctx.control_group, async_op=True).wait(timeout)


def recv_message(ctx: ParallelContext) -> tuple[Kind, bytes]:
    header = torch.empty(2, dtype=torch.int64)
    dist.broadcast(header, src=0, group=ctx.control_group)
    kind, size = Kind(int(header[0])), int(header[1])
    if not size:
        return kind, b""
    data = torch.empty(size, dtype=torch.uint8)
    dist.broadcast(data, src=0, group=ctx.control_group)
    return kind, data.numpy().tobytes()
