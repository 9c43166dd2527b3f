"""Where a rank sits: its tensor-parallel rank and pipeline stage, and the process groups.

Global rank 0 is the driver (scheduler, detokenizer, server) and must sample, so it is tensor rank
0 of the LAST pipeline stage: its logits, logprobs and prompt logprobs are local, and only the
sampled ids go back to the other ranks. Stages count down from there:

    global rank r -> tp_rank = r % tp, pp_rank = pp - 1 - r // tp

With TP=2, PP=2: ranks 0, 1 are stage 1 (the last), ranks 2, 3 stage 0 (the embedding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist


@dataclass(frozen=True)
class RankLayout:
    """The grid without any process group: pure arithmetic, unit-testable."""

    tp_size: int
    pp_size: int
    rank: int

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.pp_size - 1 - self.rank // self.tp_size

    def global_rank(self, tp_rank: int, pp_rank: int) -> int:
        return (self.pp_size - 1 - pp_rank) * self.tp_size + tp_rank

    def tp_group_ranks(self, pp_rank: int) -> list[int]:
        return [self.global_rank(t, pp_rank) for t in range(self.tp_size)]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def samples(self) -> bool:
        """This rank runs the sampler (the driver, global rank 0)."""
        return self.rank == 0


def split_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers stage `pp_rank` holds: contiguous, the first stages one more when they
    do not divide (the last stage also runs the final norm and the LM head)."""
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split over {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def kv_head_range(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """(first KV head, count) this tensor rank holds. With fewer KV heads than ranks, each head is
    replicated on tp_size / num_kv_heads consecutive ranks (their query heads share it)."""
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} KV heads do not split over {tp_size} tensor ranks")
        per = num_kv_heads // tp_size
        return tp_rank * per, per
    if tp_size % num_kv_heads:
        raise ValueError(
            f"{tp_size} tensor ranks cannot share {num_kv_heads} KV heads evenly "
            "(tensor_parallel_size must divide or be a multiple of num_key_value_heads)"
        )
    return tp_rank * num_kv_heads // tp_size, 1


@dataclass(frozen=True)
class ParallelContext:
    """A rank's layout and its process groups (made once, in init_process_groups).

    `tp_group`: this stage's tensor ranks (all-reduce, all-gather). `world_group`: every rank, on
    the data backend (nccl on GPUs, gloo on the CPU): send/recv between stages. These two (and
    `sampled_group`) time out after distributed_timeout_s (a step that waits longer for a rank
    fails). `cpu_group`: every rank on gloo, for startup (the barrier after loading, the
    KV-block minimum), with the startup timeout (loading a large model can take minutes).
    `control_group`: every rank on gloo with no practical
    timeout, for the driver's per-step messages: an idle worker waits on it for the next step as
    long as the server stays idle (a dead driver kills it; a dead worker is seen by the driver).
    `sampled_group`: every rank on the data backend, for the driver's sampled ids alone: its own
    communicator (on the GPU its own NCCL stream), so a stage's pending receive of micro-batch
    n's ids never holds up its send of micro-batch n+1 to the next stage."""

    layout: RankLayout
    tp_group: dist.ProcessGroup | None
    world_group: dist.ProcessGroup | None
    cpu_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None = None
    sampled_group: dist.ProcessGroup | None = None
    # Mixture-of-experts layers hold whole experts per tensor rank (EngineConfig.
    # enable_expert_parallel) rather than a slice of each.
    expert_parallel: bool = False

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank

    @property
    def pp_size(self) -> int:
        return self.layout.pp_size

    @property
    def pp_rank(self) -> int:
        return self.layout.pp_rank

    @property
    def rank(self) -> int:
        return self.layout.rank

    def next_stage_rank(self) -> int:
        return self.layout.global_rank(self.tp_rank, self.pp_rank + 1)

    def prev_stage_rank(self) -> int:
        return self.layout.global_rank(self.tp_rank, self.pp_rank - 1)


STARTUP_TIMEOUT_S = 1800.0
_kiln_made_default = False  # whether kiln made this process's default group (and owns it)


def init_process_groups(
    tp_size: int,
    pp_size: int,
    rank: int,
    backend: str,
    timeout_s: float,
    init_method: str = "env://",
    expert_parallel: bool = False,
) -> ParallelContext:
    """Join the default group (torchrun's env:// rendezvous: MASTER_ADDR/MASTER_PORT/RANK/
    WORLD_SIZE; or kiln's own launcher's tcp://127.0.0.1:PORT) and make the tensor-parallel and
    control groups. Every rank makes every group in the same order, as torch.distributed
    requires."""
    import datetime

    layout = RankLayout(tp_size, pp_size, rank)
    timeout = datetime.timedelta(seconds=timeout_s)
    # Starting (importing torch, loading weights) takes longer than any step should.
    startup = datetime.timedelta(seconds=max(timeout_s, STARTUP_TIMEOUT_S))
    global _kiln_made_default
    if dist.is_initialized() and _kiln_made_default:
        # torch.distributed has one default group per process: one parallel engine at a time.
        raise RuntimeError(
            "a tensor/pipeline-parallel engine already runs in this process: shut it down "
            "(LLM.shutdown()) before starting another"
        )
    if not dist.is_initialized():  # else: the caller's own group (under torchrun), joined
        _kiln_made_default = True
        dist.init_process_group(
            backend,
            init_method=init_method,
            rank=rank,
            world_size=layout.world_size,
            timeout=startup,
        )
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(
            f"the process group has {dist.get_world_size()} ranks; tensor_parallel_size x "
            f"pipeline_parallel_size is {layout.world_size}"
        )
    world = dist.new_group(timeout=timeout)  # the data backend's, with the step timeout
    cpu = dist.new_group(backend="gloo", timeout=startup)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))
    sampled = dist.new_group(timeout=timeout)
    tp_group = None
    for stage in range(pp_size):
        ranks = layout.tp_group_ranks(stage)
        group = world if len(ranks) == layout.world_size else dist.new_group(ranks, timeout=timeout)
        if stage == layout.pp_rank:
            tp_group = group
    return ParallelContext(layout, tp_group, world, cpu, control, sampled, expert_parallel)


def destroy_process_groups() -> None:
    global _kiln_made_default
    if dist.is_initialized():
        dist.destroy_process_group()
    _kiln_made_default = False
