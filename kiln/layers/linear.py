"""Linear layers that own their parameters and a `LinearMethod`: how the weights are made, loaded
from a checkpoint, processed after loading, and applied.

The model's blocks call a layer, never a raw `.weight`, so a quantization scheme is one more
method, not a special case in the model. The blocks pick the fused kernels around a projection
(residual add + RMSNorm before it; rotary + KV write, or SiLU-mul, after it) themselves; a method
only says which operands those kernels can take from it (`fused_operands`), and whether its
input may arrive in float8 (`fp8_input`, `apply_fp8`) or as int8 rows with per-token scales
(`int8_input`, `apply_int8`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch import nn

from kiln.distributed.comm import tp_all_reduce
from kiln.distributed.parallel_state import ParallelContext
from kiln.errors import ModelLoadError


@dataclass(frozen=True)
class TensorSplit:
    """How a layer's weights are cut over the tensor ranks (None on a Linear: not cut, TP=1).

    Column-parallel (`rows`): each fused block (q, k, v; gate, up) keeps rows [start, start+len)
    of its block in the full checkpoint tensor; `full_sizes` are the blocks' full row counts (to
    cut an already fused tensor). Row-parallel (`cols`): the layer keeps input columns
    [start, start+len) and its partial products are summed over the ranks after apply."""

    ctx: ParallelContext
    rows: tuple[tuple[int, int], ...] | None = None
    full_sizes: tuple[int, ...] | None = None
    cols: tuple[int, int] | None = None


class FusedOperands(NamedTuple):
    """What the fused norm + projection kernels (`ops.add_rms_norm_linear`,
    `add_rms_norm_qkv_rotary_write_kv`, `add_rms_norm_linear_silu_mul[_fp8]`) take of a
    projection, in their argument order."""

    weight: torch.Tensor  # [out, in]: the model dtype, or float8 e4m3 with weight_scale
    bias: torch.Tensor | None  # [out]
    weight_scale: torch.Tensor | None  # [out] fp32: FP8 W8A8
    input_scale: torch.Tensor | None  # [] fp32 static; None: per token (or unquantized)


@dataclass(frozen=True)
class Fp8Input:
    """That a projection takes its input as float8 e4m3 made by the op before it (the MLP's
    SiLU-mul for down_proj), and with which activation scale: per token (None) or this static
    per-tensor one ([] fp32); with `channels` ([n] int64, outlier columns) the input carries
    those channels' remainders after its own columns."""

    static_scale: torch.Tensor | None
    channels: torch.Tensor | None = None


class LinearMethod(ABC):
    """A scheme's weights and arithmetic: create, load, process after loading, apply. A method
    whose weights the fused kernels can take says so in `fused_operands`; one that takes its
    input already in float8 (made by the op before it) in `fp8_input`."""

    # True: the layer's weight_zeros hold each group's min in weight units (w = code * scale +
    # min, GGUF's blocks), so a row scaled scales its mins as well as its scales.
    weight_unit_mins: bool = False

    @abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        """Register the layer's parameters (shapes from layer.in_features/out_features)."""

    def load_weight(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        """Copy a checkpoint tensor into `param` (already narrowed to shard `shard` of a fused
        projection, if any, and to this tensor rank's part)."""
        param.copy_(loaded)

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        """A full checkpoint tensor (one fused block's, or the whole fused tensor when `shard` is
        None) into this rank's `param`: cut to the rank's part, then load_weight. A method whose
        tensors must be derived before the cut (a row-parallel weight's per-row scale) overrides
        this; at TP=1 nothing is cut."""
        self.load_weight(layer.shard_view(param, shard), shard, layer.cut(param, shard, loaded))

    def cut(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> torch.Tensor:
        """This tensor rank's part of full tensor `loaded` for `param` (Linear.cut, under TP): the
        rows or input columns Linear.standard_cut keeps. A method whose tensors are laid out
        otherwise (packed words, scales per group or block of inputs) overrides this."""
        return layer.standard_cut(param, shard, loaded)

    def input_columns(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's part of its whole weight `weight` (as this method stores it):
        the rank's input columns. A method laying out more than the input's columns (outlier
        columns) overrides this."""
        return weight.narrow(1, *layer.row_parallel_cols())

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The shape a checkpoint tensor for `shape`'s part of `param` has, once cut: the part's
        own, unless the method lays the parameter out otherwise (outlier columns)."""
        return shape

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 (optional hook)
        """Convert loaded weights into what apply() reads (quantize, transpose, ...)."""

    def engine_tensor(self, layer: Linear, name: str, param: torch.Tensor) -> torch.Tensor:
        """What an engine directory holds for the layer's parameter `name` (`param`, as loaded
        and processed): the parameter itself, unless processing moved its values elsewhere
        (INT4's codes re-laid for the sm_90 kernel), so that any model writes the same bytes."""
        return param

    @abstractmethod
    def apply(
        self, layer: Linear, ops: ModuleType, x: torch.Tensor
    ) -> torch.Tensor:  # [..., out_features]
        ...

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        """The operands the fused norm + projection kernels take (None: they take none of this
        method's; the blocks then run the norm, then apply)."""
        return None

    def fp8_input(self, layer: Linear) -> Fp8Input | None:
        """Whether apply_fp8 takes this layer's input already in float8 (None: it does not)."""
        return None

    def apply_fp8(
        self,
        layer: Linear,
        ops: ModuleType,
        x_fp8: torch.Tensor,  # [M, in_features] float8 e4m3, quantized as fp8_input says
        x_scale: torch.Tensor,  # [M, 1] or [] fp32
        out_dtype: torch.dtype,
    ) -> torch.Tensor:  # [M, out_features] in out_dtype
        """apply() on an input the op before quantized (only where fp8_input is not None)."""
        raise NotImplementedError(f"{type(self).__name__} takes no float8 input")

    def int8_input(self, layer: Linear) -> bool:
        """Whether apply_int8 takes this layer's input already as int8 rows, each with its own
        scale (what quantize_int8 makes: W8A8 INT8), quantized by the op before it."""
        return False

    def apply_int8(
        self,
        layer: Linear,
        ops: ModuleType,
        x_int8: torch.Tensor,  # [M, in_features] int8, quantized as quantize_int8 does
        x_scale: torch.Tensor,  # [M, 1] fp32
        out_dtype: torch.dtype,
    ) -> torch.Tensor:  # [M, out_features] in out_dtype
        """apply() on an input the op before quantized (only where int8_input is True)."""
        raise NotImplementedError(f"{type(self).__name__} takes no int8 input")


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model dtype; the fused kernels take them, so at batch-1 decode on the GPU
    the norm, the projection and its epilogue run as one kernel."""

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        layer.bias = None
        if layer.has_bias:
            bias = torch.empty(layer.out_features, dtype=dtype)
            layer.bias = nn.Parameter(bias, requires_grad=False)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, layer.weight, layer.bias)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        return FusedOperands(layer.weight, layer.bias, None, None)


class Linear(nn.Module):
    """y = x W^T (+ b), with `output_sizes` naming the row blocks of a fused projection
    (q, k, v or gate, up) so checkpoint tensors load into their shard."""

    # What the method registers (create_weights), named so they type as tensors rather than
    # nn.Module.__getattr__'s union: every method sets weight and bias; float8 methods also
    # weight_scale and input_scale (None: per-token); outlier columns also outlier_index.
    weight: torch.Tensor
    bias: torch.Tensor | None
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None
    outlier_index: torch.Tensor
    # INT4 W4A16 (kiln.layers.quantization.int4): group scales, zero points, act-order;
    # weight_scales also block FP8's and W8A16's [out, groups] scales.
    weight_scales: torch.Tensor
    weight_zeros: torch.Tensor
    weight_g_idx: torch.Tensor
    input_order: torch.Tensor | None
    weight_mma: torch.Tensor | None  # INT4's codes re-laid for the sm_90 kernel, where made
    # False: its block multiplies its weight in itself and never applies it (MLA's absorbed
    # kv_b_proj, kept in the model dtype): calibration observes no input to it.
    applied: bool = True

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        output_sizes: list[int] | None = None,
        method: LinearMethod | None = None,
        dtype: torch.dtype | None = None,
        split: TensorSplit | None = None,
    ) -> None:
        super().__init__()
        # in/out features and output_sizes are this rank's (the cut sizes under `split`).
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.split = split
        # The row-parallel all-reduce; None at TP=1 and for column-parallel layers.
        self.reduce = split.ctx if split is not None and split.cols is not None else None
        self.output_sizes = output_sizes or [out_features]
        if sum(self.output_sizes) != out_features:
            raise ValueError(f"output_sizes {self.output_sizes} do not sum to {out_features}")
        self.method = method or UnquantizedLinearMethod()
        self.method.create_weights(self, dtype)

    def forward(self, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, ops, x)
        if self.reduce is not None:  # row-parallel: sum the partial products over tensor ranks
            tp_all_reduce(self.reduce, y)
        return y

    def apply_fp8(
        self, ops: ModuleType, x_fp8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:  # [M, out_features]
        """forward() on an input the op before quantized as `method.fp8_input` says."""
        y = self.method.apply_fp8(self, ops, x_fp8, x_scale, out_dtype)
        if self.reduce is not None:  # row-parallel, as forward()
            tp_all_reduce(self.reduce, y)
        return y

    def apply_int8(
        self, ops: ModuleType, x_int8: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype
    ) -> torch.Tensor:  # [M, out_features]
        """forward() on an input the op before quantized to int8 (`method.int8_input`)."""
        y = self.method.apply_int8(self, ops, x_int8, x_scale, out_dtype)
        if self.reduce is not None:  # row-parallel, as forward()
            tp_all_reduce(self.reduce, y)
        return y

    @torch.no_grad()
    def scale_output_rows(self, rows: slice, factor: float, bias: bool = True) -> None:
        """Multiply output rows `rows` by `factor`: through the weight scales where the method
        keeps them (per row, or per row of each group or block; INT4's group scales; and the
        mins of GGUF's groups), else the weight's rows; the bias's rows too with `bias`."""
        scale = getattr(self, "weight_scale", None)
        if scale is None:
            scale = getattr(self, "weight_scales", None)
        target = scale if scale is not None else self.weight
        target[rows] *= factor
        if self.method.weight_unit_mins:
            self.weight_zeros[rows] *= factor
        if bias and self.bias is not None:
            self.bias[rows] *= factor

    def row_parallel_cols(self) -> tuple[int, int]:
        """(start, length) of the input columns this row-parallel rank keeps."""
        split = self.split
        if split is None or split.cols is None:
            raise ValueError(f"{self.extra_repr()}: not a row-parallel layer")
        return split.cols

    def row_parallel_groups(self, group_size: int, what: str) -> tuple[int, int]:
        """(first, count) of the groups of `group_size` inputs (a scale's columns) that this
        row-parallel rank's input columns hold whole; a ModelLoadError when a cut falls inside
        one (its partial sums would need another rank's scale)."""
        start, length = self.row_parallel_cols()
        if start % group_size or length % group_size:
            raise ModelLoadError(
                f"{what} under tensor parallelism: this rank's input columns [{start}, "
                f"{start + length}) of {self.extra_repr()} split a group of {group_size} "
                "inputs; each rank needs whole groups (another tensor_parallel_size, or 1)"
            )
        return start // group_size, length // group_size

    def shard_view(self, param: torch.Tensor, shard: int | None) -> torch.Tensor:
        """The rows of `param` that fused shard `shard` (an index into output_sizes) owns."""
        if shard is None:
            return param
        start = sum(self.output_sizes[:shard])
        return param.narrow(0, start, self.output_sizes[shard])

    def weight_loader(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        """A full checkpoint tensor (shard `shard` of a fused projection, or the whole fused
        tensor when None) into `param`, through the method (which cuts it under TP)."""
        self.method.load_checkpoint_tensor(self, param, shard, loaded)

    def cut(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> torch.Tensor:
        """This tensor rank's part of full checkpoint tensor `loaded` for `param` (`loaded`
        itself at TP=1), as the method cuts it (LinearMethod.cut: standard_cut unless its
        layout says otherwise)."""
        if self.split is None or loaded.dim() == 0:
            return loaded
        return self.method.cut(self, param, shard, loaded)

    def standard_cut(
        self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> torch.Tensor:
        """Column-parallel: the rank's rows of each fused block (weights, biases and per-row
        scales alike; a tensor shorter than the blocks' full sizes, the vocabulary under a
        padded LM head, is first zero-padded to them). Row-parallel: the weight's input columns
        (method.input_columns); the bias on tensor rank 0 only (it is added once, before the
        sum); per-row scales whole."""
        split = self.split
        if split is None or loaded.dim() == 0:
            return loaded
        if split.rows is not None:
            assert split.full_sizes is not None, "a column-parallel split has its full sizes"
            padded = sum(split.full_sizes)
            if loaded.shape[0] < padded:  # the float8 LM head: rows past the vocabulary are 0
                pad = loaded.new_zeros(padded - loaded.shape[0], *loaded.shape[1:])
                loaded = torch.cat([loaded, pad])
            if shard is not None:
                start, length = split.rows[shard]
                return loaded.narrow(0, start, length)
            blocks, offset = [], 0
            for (start, length), full in zip(split.rows, split.full_sizes):
                blocks.append(loaded.narrow(0, offset + start, length))
                offset += full
            return torch.cat(blocks) if len(blocks) > 1 else blocks[0]
        if param is self.weight:
            return self.method.input_columns(self, loaded)
        if param is self.bias and split.ctx.tp_rank != 0:
            return torch.zeros_like(loaded)
        return loaded

    def extra_repr(self) -> str:
        method = type(self.method).__name__
        return f"in={self.in_features}, out={self.out_features}, bias={self.has_bias}, {method}"
