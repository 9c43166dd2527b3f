"""Outlier columns for FP8 W8A8: each projection's loudest input channels (chosen on the
calibration text) carried as a second float8 term, so their values keep ~7 bits of mantissa
instead of e4m3's 3.

Why: a per-token scale makes each row's largest value exact (it *is* the scale, 448 x scale); a
static one rounds it to 3 bits like any other. Models with massive activations (SmolLM2: a few
channels in the thousands) keep their largest values in a few fixed channels, and those values'
rounding is as large as the rest of the row's together, which is most of what static scales
lose against per-token ones; underflow costs almost nothing (measured on SmolLM2's
calibration text).

The arithmetic, for a projection with input scale s (static, or per token) and chosen channels
J (n of them, a multiple of 16 so the GEMM's K stays one):

    q   = e4m3(x / s)                         the engine's usual float8 input, [M, K]
    r_J = e4m3(x_J / s - q_J)                 the chosen channels' remainders, [M, n]
    y   = s * ([q, r_J] @ [W, W_J]^T) * w     one float8 GEMM, K + n long

[W, W_J] is the float8 weight with the chosen channels' columns appended (the same codes, the same
per-row scale w). The GEMM is the engine's own (`ops.fp8_matmul`); the quantizing op before it
(the norm, the SiLU-mul, or the quantize kernel) writes [q, r_J] in one pass when given the
channels (`channels=` of ops.quantize_fp8, add_rms_norm_quant_fp8, silu_and_mul_quant_fp8;
reference.fp8_remainder is the arithmetic). What these projections lose against plain FP8 is the
fused small-batch kernels (norm, quantization and GEMV in one at a handful of rows): they always
run the quantizing op, then the GEMM (at a handful of rows the small-batch GEMV on its float8
output).

Under tensor parallelism a column-parallel projection (qkv, gate_up) sees the whole input and
keeps every chosen channel, with its rows. A row-parallel one (o_proj, down) keeps the chosen
channels inside its input columns, renumbered, and pads them to a multiple of 16 with other
channels of its own whose appended weight columns are zero. Their remainders then add exactly
nothing, and the ranks' partial sums add up to the one-process product.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Literal

import torch

from kiln.layers.linear import Fp8Input, FusedOperands, Linear
from kiln.layers.quantization import RowRounder
from kiln.layers.quantization.fp8 import Fp8LinearMethod

# The GEMM's K must stay a multiple of 16 (torch._scaled_mm's requirement).
COLUMN_MULTIPLE = 16


def choose_channels(channel_amax: Mapping[str, torch.Tensor], count: int) -> dict[str, list[int]]:
    """Layer name -> its `count` input channels of largest calibration amax, ascending."""
    chosen = {}
    for name, amax in channel_amax.items():
        if count > amax.numel():
            raise ValueError(
                f"{count} outlier columns for {name!r}, which has {amax.numel()} input channels"
            )
        chosen[name] = sorted(int(i) for i in amax.topk(count).indices)
    return chosen


class OutlierColumnsFp8LinearMethod(Fp8LinearMethod):
    """Fp8LinearMethod whose weight is [out, in + n]: the float8 weight, then copies of its
    `channels` columns; apply() appends the channels' remainders to the float8 input."""

    def __init__(
        self,
        activation_scheme: Literal["dynamic", "static"],
        input_scale: float | None = None,
        round_rows: RowRounder | None = None,
        rounded: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        channels: Sequence[int],
    ) -> None:
        super().__init__(activation_scheme, input_scale, round_rows, rounded)
        if not channels or len(channels) % COLUMN_MULTIPLE:
            raise ValueError(
                f"outlier columns come in multiples of {COLUMN_MULTIPLE}, got {len(channels)}"
            )
        if len(set(channels)) != len(channels):
            raise ValueError("outlier columns name each channel once")
        self.channels = list(channels)
        # Per appended column of this layer: its position in `channels`, or None for a
        # row-parallel rank's padding (a zero column).
        self.slots: list[int | None] = []

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        local = self._local_channels(layer)
        super().create_weights(layer, dtype)
        shape = (layer.out_features, layer.in_features + len(local))
        layer.weight = torch.nn.Parameter(
            torch.empty(shape, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        # On the model's device from the start (a copy made while a CUDA graph is captured
        # would fail); not persistent: the manifest names the channels, not the weights.
        layer.register_buffer("outlier_index", torch.tensor(local), persistent=False)

    def _local_channels(self, layer: Linear) -> list[int]:
        """This layer's channels in its own input's numbering (sets self.slots): all of them,
        unless a row-parallel rank keeps input columns [start, start + length) only."""
        split = layer.split
        if split is None or split.cols is None:
            if max(self.channels) >= layer.in_features:
                raise ValueError(
                    f"outlier column {max(self.channels)} is past the layer's "
                    f"{layer.in_features} input channels"
                )
            self.slots = list(range(len(self.channels)))
            return self.channels
        start, length = split.cols
        mine = [(c - start, i) for i, c in enumerate(self.channels) if start <= c < start + length]
        padded = max(COLUMN_MULTIPLE, -(-len(mine) // COLUMN_MULTIPLE) * COLUMN_MULTIPLE)
        taken = {c for c, _ in mine}
        spare = [c for c in range(length) if c not in taken][: padded - len(mine)]
        pairs = sorted(mine + [(c, None) for c in spare])
        self.slots = [i for _, i in pairs]
        return [c for c, _ in pairs]

    def input_columns(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's part of the whole [out, in + n] weight (an engine's): its
        input columns, then the appended columns of its channels (zeros for its padding)."""
        start, length = layer.row_parallel_cols()
        whole = weight.view(torch.uint8)
        whole_in = whole.shape[1] - len(self.channels)
        index = [whole_in + (0 if position is None else position) for position in self.slots]
        extra = self._appended(whole, index)
        return torch.cat([whole[:, start : start + length], extra], 1).view(weight.dtype)

    def _appended(self, columns: torch.Tensor, index: torch.Tensor | list[int]) -> torch.Tensor:
        """The appended columns `columns[:, index]` (uint8 codes, one per slot), with a
        row-parallel rank's padding slots zeroed: they add nothing."""
        extra = columns[:, index]
        padding = [j for j, position in enumerate(self.slots) if position is None]
        if padding:
            extra[:, padding] = 0
        return extra

    def process_weights_after_loading(self, layer: Linear) -> None:
        """On CUDA, the weight's rows re-laid ROW_ALIGN bytes apart (the Triton quantizing
        kernels lay the input out so too): cuBLAS's float8 GEMM over K + n columns runs 20-33%
        slower otherwise. Its values and shape are unchanged; the engine writer saves it
        contiguous."""
        weight = layer.weight
        if not weight.is_cuda:
            return
        from kiln.kernels.triton.fp8_gemm import aligned_rows

        relaid = aligned_rows(weight.shape[0], weight.shape[1], weight.device)
        relaid.copy_(weight)
        layer.weight = torch.nn.Parameter(relaid, requires_grad=False)

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        if param is layer.weight:  # the source's weight: the appended columns are made here
            return (shape[0], layer.in_features)
        return shape

    def engine_weight(self, codes: torch.Tensor) -> torch.Tensor:
        """[out, in + n]: the codes, then the chosen channels' columns again."""
        whole = codes.view(torch.uint8)
        return torch.cat([whole, whole[:, self.channels]], 1).view(codes.dtype)

    def store_codes(self, param: torch.Tensor, codes: torch.Tensor) -> None:
        k = codes.shape[1]
        param[:, :k].copy_(codes)
        index = self.layer().outlier_index.to(codes.device)
        param[:, k:].copy_(self._appended(codes.view(torch.uint8), index).view(codes.dtype))

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        x2d = x.reshape(-1, layer.in_features)
        x_fp8, scale = ops.quantize_fp8(x2d, layer.input_scale, layer.outlier_index)
        y = self.apply_fp8(layer, ops, x_fp8, scale, x.dtype)
        return y.reshape(*x.shape[:-1], layer.out_features)

    def fp8_input(self, layer: Linear) -> Fp8Input | None:
        return Fp8Input(layer.input_scale, layer.outlier_index)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        """None: the fused small-batch kernels take no outlier columns. The blocks then run the
        norm (or SiLU-mul) quantizing kernel with this layer's channels, then apply_fp8."""
        return None
