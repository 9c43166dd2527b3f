"""Linear layers that own their parameters and a `LinearMethod`: how the weights are made, loaded
from a checkpoint, processed after loading, and applied.

The model's forward calls a layer, never a raw `.weight`, so a quantization scheme (FP8 next) is
one more method, not a special case in the model. A layer's entry points include the fused ones
the decoder uses (residual add + RMSNorm before the projection; rotary + KV write, or SiLU-mul,
after it): a method with a fused kernel for them overrides them; the defaults compose the method's
own `apply` with the reference-shaped kernels of `ops`, so a new method works before it is fast.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from kiln.distributed.comm import tp_all_reduce
from kiln.distributed.parallel_state import ParallelContext
from kiln.kernels.reference import split_qkv_heads


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


@dataclass(frozen=True)
class Fp8Input:
    """That a projection takes its input as float8 e4m3 made by the op before it (the MLP's
    SiLU-mul for down_proj), and with which activation scale: per token (None) or this static
    per-tensor one ([] fp32); with `channels` ([n] int64, outlier columns) the input carries
    those channels' remainders after its own columns."""

    static_scale: torch.Tensor | None
    channels: torch.Tensor | None = None


class LinearMethod(ABC):
    """A scheme's weights and arithmetic. Subclasses define create_weights and apply; the fused
    entry points default to compositions of `apply` with `ops`' norm, rotary and activation."""

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

    def input_columns(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor:
        """A row-parallel layer's part of its whole weight `weight` (as this method stores it):
        the rank's input columns. A method laying out more than the input's columns (outlier
        columns) overrides this."""
        return weight.narrow(1, *layer.split.cols)

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        """The shape a checkpoint tensor for `shape`'s part of `param` has, once cut: the part's
        own, unless the method lays the parameter out otherwise (outlier columns)."""
        return shape

    def process_weights_after_loading(self, layer: Linear) -> None:  # noqa: B027 (optional hook)
        """Convert loaded weights into what apply() reads (quantize, transpose, ...)."""

    @abstractmethod
    def apply(
        self, layer: Linear, ops: ModuleType, x: torch.Tensor
    ) -> torch.Tensor:  # [..., out_features]
        ...

    def add_rms_norm_apply(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(rms_norm(x + residual)), x + residual); with no residual, x is the stream."""
        if residual is None:
            normed, summed = ops.rms_norm(x, norm_weight, eps), x
        else:
            normed, summed = ops.fused_add_rms_norm(x, residual, norm_weight, eps)
        return self.apply(layer, ops, normed), summed

    def add_rms_norm_qkv_rotary_write_kv(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (rotated query, x + residual)
        """The attention block up to attending: norm, qkv projection, rotary, the KV write."""
        qkv, summed = self.add_rms_norm_apply(layer, ops, x, residual, norm_weight, eps)
        query, key, value = split_qkv_heads(qkv, cos_sin_cache.shape[1], k_cache.shape[2])
        rotated = ops.rotary_embedding_write_kv(
            positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping
        )
        return rotated, summed

    def add_rms_norm_silu_mul(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (silu(gate) * up, x + residual)
        """The MLP up to its down projection."""
        gate_up, summed = self.add_rms_norm_apply(layer, ops, x, residual, norm_weight, eps)
        return ops.silu_and_mul(gate_up), summed

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

    def add_rms_norm_silu_mul_fp8(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        into: Fp8Input,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """add_rms_norm_silu_mul for a down projection that takes float8 (`into`): (activation,
        its scale, x + residual), the activation float8 where the method's kernels make it so,
        else in the model dtype with scale None (the down projection then quantizes it)."""
        activation, summed = self.add_rms_norm_silu_mul(layer, ops, x, residual, norm_weight, eps)
        return activation, None, summed


class FusedOpsLinearMethod(LinearMethod):
    """A method whose fused entry points are single `ops` calls (one kernel at batch-1 decode on
    the GPU: norm, projection and epilogue), given the weight and what `op_scales` adds to it."""

    def op_scales(self, layer: Linear) -> tuple[torch.Tensor | None, ...]:
        """The scale arguments the ops take after the weight (none: unquantized)."""
        return ()

    def add_rms_norm_apply(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm_linear(
            x, residual, norm_weight, eps, layer.weight, layer.bias, *self.op_scales(layer)
        )

    def add_rms_norm_qkv_rotary_write_kv(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.add_rms_norm_qkv_rotary_write_kv(
            x, residual, norm_weight, eps, layer.weight, layer.bias,
            positions, cos_sin_cache, k_cache, v_cache, slot_mapping, *self.op_scales(layer),
        )  # fmt: skip

    def add_rms_norm_silu_mul(
        self,
        layer: Linear,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer.has_bias:  # the fused kernel takes no bias: compose instead
            return super().add_rms_norm_silu_mul(layer, ops, x, residual, norm_weight, eps)
        return ops.add_rms_norm_linear_silu_mul(
            x, residual, norm_weight, eps, layer.weight, *self.op_scales(layer)
        )


class UnquantizedLinearMethod(FusedOpsLinearMethod):
    """Weights in the model dtype. Every entry point is one `ops` call, so at batch-1 decode on
    the GPU the norm, the projection and its epilogue run as one kernel."""

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        shape = (layer.out_features, layer.in_features)
        layer.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        layer.bias = None
        if layer.has_bias:
            bias = torch.empty(layer.out_features, dtype=dtype)
            layer.bias = nn.Parameter(bias, requires_grad=False)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, layer.weight, layer.bias)


class Linear(nn.Module):
    """y = x W^T (+ b), with `output_sizes` naming the row blocks of a fused projection
    (q, k, v or gate, up) so checkpoint tensors load into their shard."""

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

    # The decoder's fused entry points (see LinearMethod): residual add + RMSNorm, then this
    # projection, then its epilogue.

    def add_rms_norm_qkv_rotary_write_kv(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (rotated query, x + residual)
        return self.method.add_rms_norm_qkv_rotary_write_kv(
            self, ops, x, residual, norm_weight, eps,
            positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        )  # fmt: skip

    def add_rms_norm_silu_mul(
        self,
        ops: ModuleType,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (silu(gate) * up, x + residual)
        return self.method.add_rms_norm_silu_mul(self, ops, x, residual, norm_weight, eps)

    def silu_mul_into(
        self,
        ops: ModuleType,
        down: Linear,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (down(silu(gate) * up), x + residual)
        """The MLP block from this gate_up projection through `down`. When down's method takes
        float8 input (FP8 W8A8), the activation may reach it quantized by the SiLU-mul's own
        kernel: no model-dtype activation written and re-read, no quantize kernel of its own."""
        into = down.method.fp8_input(down)
        if into is None:
            activation, summed = self.add_rms_norm_silu_mul(ops, x, residual, norm_weight, eps)
            return down(ops, activation), summed
        activation, scale, summed = self.method.add_rms_norm_silu_mul_fp8(
            self, ops, x, residual, norm_weight, eps, into
        )
        if scale is None:
            return down(ops, activation), summed
        y = down.method.apply_fp8(down, ops, activation, scale, x.dtype)
        if down.reduce is not None:  # row-parallel, as forward()
            tp_all_reduce(down.reduce, y)
        return y, summed

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
        itself at TP=1). Column-parallel: the rank's rows of each fused block (weights, biases
        and per-row scales alike; a tensor shorter than the blocks' full sizes, the vocabulary
        under a padded LM head, is first zero-padded to them). Row-parallel: the weight's input
        columns; the bias on tensor rank 0 only (it is added once, before the sum); per-row
        scales whole."""
        split = self.split
        if split is None or loaded.dim() == 0:
            return loaded
        if split.rows is not None:
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
