"""How a mixture-of-experts layer's experts are cut over the tensor ranks (`ExpertShard`).

Tensor parallelism (vLLM's default under --tensor-parallel-size): each rank holds a slice of
every expert's intermediate width, the gate and up rows [start, start + n) and the same down
columns, as a dense MLP is cut. Expert parallelism (--enable-expert-parallel): each rank holds
whole experts, a contiguous range of them (the first ranks one more when they do not divide).

Either way every rank has every token (the attention before the block is tensor-parallel and
all-reduced) and runs the replicated router; under EP a rank maps the chosen ids to its own
experts and the others to -1, which the fused-MoE kernels skip, so each (token, expert) pair is
computed once, on the rank holding the expert. The block's one all-reduce then sums the parts,
as the dense MLP's does: no token moves before it. An all-to-all dispatch pays only where ranks
hold different tokens (data-parallel attention), which kiln does not have."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kiln.distributed.parallel_state import ParallelContext
from kiln.kernels.reference import FP8_BLOCK

# Stacked experts' weights [E, rows, cols] -> (float8 codes, their scales [E] or [E, rows]).
Quantize = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """(first expert, count) rank `ep_rank` of `ep_size` holds: contiguous, the first ranks one
    more when they do not divide (vLLM's linear placement). A rank with none is refused."""
    if num_experts < ep_size:
        raise ValueError(
            f"num_experts={num_experts} cannot be spread over {ep_size} expert-parallel ranks "
            "(each would hold none); use fewer ranks or tensor-parallel experts (no "
            "--enable-expert-parallel)"
        )
    base, extra = divmod(num_experts, ep_size)
    return ep_rank * base + min(ep_rank, extra), base + (1 if ep_rank < extra else 0)


def shard_moe_fields(
    num_experts: int,
    moe_width: int,
    shared_width: int,
    tp_size: int,
    tp_rank: int,
    expert_parallel: bool,
) -> dict[str, object]:
    """The MoE fields of one tensor rank's ModelConfig (shard_config): under TP each expert's
    width (`moe_width`) cut by tp_size, under EP this rank's expert range; the shared expert
    (`shared_width`, 0: none) is a dense MLP and cut by tp_size either way. ValueError, naming
    the field, for a split that cannot be made."""
    fields: dict[str, object] = {}
    if shared_width:
        if shared_width % tp_size:
            raise ValueError(
                f"shared_expert_intermediate_size={shared_width} does not split over "
                f"tensor_parallel_size={tp_size}"
            )
        fields["shared_expert_intermediate_size"] = shared_width // tp_size
    if expert_parallel:
        fields["expert_range"] = expert_range(num_experts, tp_size, tp_rank)
        return fields
    if moe_width % tp_size:
        raise ValueError(
            f"moe_intermediate_size={moe_width} does not split over tensor_parallel_size="
            f"{tp_size} (--enable-expert-parallel spreads whole experts instead)"
        )
    fields["moe_intermediate_size"] = moe_width // tp_size
    return fields


@dataclass(frozen=True)
class ExpertShard:
    """One rank's part of a FusedMoE's experts: `experts` (first, count) of the router's
    `num_experts` held whole, and `columns` (start, length) of each one's `full_width`
    intermediate columns (all of them under EP; all experts under TP). Cuts tensors named as
    the layer's parameters: w13_weight [.., 2 * width, hidden] ([gate; up] rows), w2_weight
    [.., hidden, width], their scales (one per expert, one per row, or one per row and 128
    inputs: w2's by whole blocks of its columns; INT4's w2 words 8 columns each, its group
    scales and zeros by whole groups, per-channel ones whole) and biases (w13_bias
    by rows; w2_bias, added after the sum, on the first tensor rank only under TP)."""

    ctx: ParallelContext
    num_experts: int
    experts: tuple[int, int]
    columns: tuple[int, int]
    full_width: int

    @property
    def expert_parallel(self) -> bool:
        return self.experts[1] != self.num_experts

    def holds(self, expert: int) -> bool:
        first, count = self.experts
        return first <= expert < first + count

    def local_ids(self, topk_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens, top_k]
        """The router's ids as this rank's expert indices; -1 for another rank's (skipped by
        the kernels). No change under TP. Shapes fixed by the input: CUDA graphs capture it."""
        if not self.expert_parallel:
            return topk_ids
        first, count = self.experts
        local = topk_ids - first
        return torch.where((local >= 0) & (local < count), local, -1)

    def cut_expert(self, param: str, tensor: torch.Tensor, stacked: bool = False) -> torch.Tensor:
        """This rank's columns of one expert's whole tensor for `param` (with `stacked`, of
        every expert's, the experts first): w13's gate and up rows, w2's columns; scales ride
        with their rows (w2's rows are the hidden size, whole; a per-expert scale is whole)."""
        start, length = self.columns
        d = 1 if stacked else 0  # the expert's first dimension
        if length == self.full_width or tensor.dim() <= d:
            return tensor
        if param.startswith("w13"):
            gate = tensor.narrow(d, start, length)
            up = tensor.narrow(d, self.full_width + start, length)
            return torch.cat([gate, up], dim=d)
        if param == "w2_weight":  # INT4's int32 words hold 8 columns each (moe_int4.py)
            per = 8 if tensor.dtype == torch.int32 else 1
            return tensor.narrow(d + 1, start // per, length // per)
        if param in ("w2_weight_scales", "w2_weight_zeros") and tensor.shape[d + 1] > 1:
            group = self.full_width // tensor.shape[d + 1]  # INT4 groups, whole (create_weights)
            return tensor.narrow(d + 1, start // group, length // group)
        if param == "w2_weight_scale" and tensor.dim() == d + 2:  # per 128 inputs: whole blocks
            if start % FP8_BLOCK:
                raise ValueError(f"expert columns from {start} split a 128-wide scale block")
            return tensor.narrow(d + 1, start // FP8_BLOCK, -(-length // FP8_BLOCK))
        if param == "w2_bias" and self.ctx.tp_rank != 0:  # every rank's part sums into one
            return torch.zeros_like(tensor)
        return tensor

    def cut_stacked(self, param: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of a stacked [num_experts, ...] tensor for `param` (an engine
        directory's, or a checkpoint that stores its experts stacked)."""
        first, count = self.experts
        return self.cut_expert(param, tensor.narrow(0, first, count), stacked=True)

    def keep(
        self, param: str, expert: int, whole: torch.Tensor, quantize: Quantize | None = None
    ) -> list[tuple[str, torch.Tensor]]:
        """What this rank keeps of expert `expert`'s whole checkpoint tensor for `param`, as
        (name suffix, tensor) pairs to stack: nothing for another rank's expert; with
        `quantize` (float8 experts) the codes and scales, quantized from the whole expert
        before the cut, so every rank's float8 bytes and scales equal the one-process
        model's."""
        if not self.holds(expert):
            return []
        if quantize is None:
            return [("", self.cut_expert(param, whole))]
        codes, scale = quantize(whole[None])
        scale_name = f"{param}_scale"
        return [
            ("", self.cut_expert(param, codes[0])),
            ("_scale", self.cut_expert(scale_name, scale[0])),
        ]


def rank_shard(
    ctx: ParallelContext | None,
    num_experts: int,
    held: tuple[int, int] | None,
    width: int,
) -> ExpertShard | None:
    """A tensor rank's ExpertShard from its shard_config's fields: `held` its expert_range
    (None: a slice of every expert), `width` its moe_intermediate_size. None at TP=1."""
    if ctx is None or ctx.tp_size == 1:
        return None
    if held is not None:  # expert parallel: whole experts
        return ExpertShard(ctx, num_experts, held, (0, width), width)
    columns = (ctx.tp_rank * width, width)
    return ExpertShard(ctx, num_experts, (0, num_experts), columns, width * ctx.tp_size)
