"""The collectives the parallel model calls. Each is only reached when its group has more than
one rank (layers check `tp_size > 1` before calling), so TP=1 runs none of them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from kiln.distributed.parallel_state import ParallelContext


def tp_all_reduce(ctx: ParallelContext, x: torch.Tensor) -> torch.Tensor:
    """Sum of the row-parallel partial products over the tensor ranks, in place."""
    dist.all_reduce(x, group=ctx.tp_group)
    return x


def tp_all_gather_last_dim(ctx: ParallelContext, x: torch.Tensor) -> torch.Tensor:
    """[n, v_local] on every tensor rank -> [n, tp * v_local], rank-ordered."""
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=ctx.tp_group)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(ctx: ParallelContext, x: torch.Tensor) -> None:
    dist.send(x.contiguous(), dst=ctx.next_stage_rank(), group=ctx.world_group)


def recv_from_prev_stage(ctx: ParallelContext, shape: tuple[int, ...], like: torch.Tensor):
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    dist.recv(out, src=ctx.prev_stage_rank(), group=ctx.world_group)
    return out


def broadcast_sampled(
    ctx: ParallelContext, sampled: torch.Tensor | None, num_rows: int, device: torch.device
) -> tuple[torch.Tensor, dist.Work | None]:
    """The driver's sampled ids [num_rows] (int64) on every rank, so each rank's runner keeps the
    same token history (and feeds the next step's inputs from it).

    The driver sends and gets no handle back. Every other rank gets the tensor and the pending
    receive's handle, to wait on only when it reads the ids: an earlier pipeline stage then goes
    on to the next micro-batch's forward while the last stage still computes this one (on the
    GPU the receive is queued on NCCL's stream, not on the compute stream)."""
    if sampled is not None:
        if sampled.dtype != torch.int64:
            sampled = sampled.to(torch.int64)
        dist.broadcast(sampled, src=0, group=ctx.sampled_group)
        return sampled, None
    sampled = torch.empty(num_rows, dtype=torch.int64, device=device)
    return sampled, dist.broadcast(sampled, src=0, group=ctx.sampled_group, async_op=True)


def barrier(ctx: ParallelContext) -> None:
    """Every rank got here (startup: all have loaded, before the memory plan's collectives)."""
    dist.barrier(group=ctx.cpu_group)


def all_reduce_min(ctx: ParallelContext, value: int) -> int:
    """The smallest `value` over every rank (the KV blocks that fit on all of them)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.cpu_group)
    return int(t.item())
