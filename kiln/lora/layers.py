"""LoRA inside a projection: the base layer's own method, then each token's adapter (by its
slot) added to the output with one shrink and one expand over the step's packed tokens.

`LoRALinearMethod` wraps the projection's method (bf16/fp32, FP8 or INT4 alike). It offers the
fused norm + projection kernels none of its operands (they never write the normed input LoRA's
shrink reads), but keeps the base's float8 input: where the base takes its input quantized by
the op before it (FP8 W8A8: the norm that quantizes, the SiLU-mul that quantizes), the shrink
reads that same float8 input and its scale, so those fused ops stay (kiln.models.blocks).
A step in which no token has an adapter runs no LoRA kernel: eager, the layers skip them; its
decode graph is one captured without them (kiln.runtime.graph_runner)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from kiln.layers.linear import Fp8Input, FusedOperands, Linear, LinearMethod


class LoRAInputs:
    """Each token's adapter slot for the step (-1: the base model alone), and the step's rows
    grouped by slot (rows without an adapter last), in persistent device buffers every LoRA
    layer reads the first num_tokens of: their addresses never change, so the decode CUDA
    graphs read each step's as they read its input ids. The kernels visit the rows in that
    order, so a tile of rows holds one or two adapters, not every adapter of the step."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        # One allocation, one copy a step: slots, then (16-entry aligned) the order.
        self._cap = cap = -(-max_num_tokens // 16) * 16
        self._dev = torch.full((2 * cap,), -1, dtype=torch.int32, device=device)
        self._host = torch.full((2 * cap,), -1, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._host_np[cap:] = np.arange(cap, dtype=np.int32)
        self._dev[cap:].copy_(self._host[cap:])
        self.token_slots = self._dev[:max_num_tokens]
        self.token_order = self._dev[cap : cap + max_num_tokens]
        self._copied = torch.cuda.Event() if pin else None
        # Whether a token of the step has an adapter: a step without runs no LoRA kernel (and
        # leaves the buffers as they are). True until the first step: the memory profile and
        # the graphs' capture run (and compile) the kernels.
        self.active = True
        self._views: tuple[torch.Tensor, torch.Tensor] = (self.token_slots, self.token_order)

    def fill(self, request_slots: list[int], num_scheduled: list[int], num_rows: int) -> None:
        """The step's slots: request i's for its num_scheduled[i] tokens (batch order), -1
        for the padding rows up to num_rows (a decode batch padded to a graph's size); and
        their order."""
        n = sum(num_scheduled)
        rows = max(n, num_rows)
        self.active = max(request_slots, default=-1) >= 0
        if self._views[0].shape[0] != rows:
            self._views = (self.token_slots[:rows], self.token_order[:rows])
        if not self.active:
            return  # no kernel reads them (eager steps and graphs skip LoRA)
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffer
        host, cap = self._host_np, self._cap
        slots = host[:rows]
        if n == len(request_slots):  # one token each (decodes)
            slots[:n] = request_slots
        else:
            slots[:n] = np.repeat(np.asarray(request_slots, dtype=np.int32), num_scheduled)
        slots[n:] = -1
        # int16 keys: numpy's stable sort is then a radix sort, linear in the rows.
        key = np.where(slots < 0, np.int16(32767), slots.astype(np.int16))
        host[cap : cap + rows] = np.argsort(key, kind="stable")
        self._dev[: cap + rows].copy_(self._host[: cap + rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def slots_for(self, num_rows: int) -> torch.Tensor:
        """The first num_rows token slots (the step's view when it has that many rows)."""
        step = self._views[0]
        return step if step.shape[0] == num_rows else self.token_slots[:num_rows]

    def order_for(self, num_rows: int) -> torch.Tensor:
        """The step's order of its num_rows rows."""
        step = self._views[1]
        return step if step.shape[0] == num_rows else self.token_order[:num_rows]


class LoRALinearMethod(LinearMethod):
    """The base method's weights and arithmetic, plus the slots' adapters: `lora_a`
    [max_loras, slices * max_rank, in] and `lora_b` [max_loras, out, max_rank] (zero-padded
    ranks, the scaling folded into B), written in place as adapters come and go."""

    def __init__(
        self,
        base: LinearMethod,
        inputs: LoRAInputs,
        layer: Linear,
        max_loras: int,
        max_rank: int,
        dtype: torch.dtype,  # the model's activations'
    ) -> None:
        self.base = base
        self.inputs = inputs
        device = layer.weight.device
        slices = len(layer.output_sizes)
        self.max_rank = max_rank
        self.lora_a = torch.zeros(
            max_loras, slices * max_rank, layer.in_features, dtype=dtype, device=device
        )
        self.lora_b = torch.zeros(
            max_loras, layer.out_features, max_rank, dtype=dtype, device=device
        )
        bounds = [0]
        for size in layer.output_sizes:
            bounds.append(bounds[-1] + size)
        self.slice_bounds = tuple(bounds)

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        self.base.create_weights(layer, dtype)

    def load_weight(self, param: torch.Tensor, shard: int | None, loaded: torch.Tensor) -> None:
        self.base.load_weight(param, shard, loaded)

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        self.base.load_checkpoint_tensor(layer, param, shard, loaded)

    def cut(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> torch.Tensor:
        return self.base.cut(layer, param, shard, loaded)

    def input_columns(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor:
        return self.base.input_columns(layer, weight)

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        return self.base.checkpoint_shape(layer, param, shape)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.base.process_weights_after_loading(layer)

    def engine_tensor(self, layer: Linear, name: str, param: torch.Tensor) -> torch.Tensor:
        return self.base.engine_tensor(layer, name, param)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, ops, x)
        if self.inputs.active:
            self._add(ops, x.reshape(-1, x.shape[-1]), None, y)
        return y

    def apply_fp8(
        self,
        layer: Linear,
        ops: ModuleType,
        x_fp8: torch.Tensor,  # [M, in_features] float8 e4m3
        x_scale: torch.Tensor,  # [M, 1] or [] fp32
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        y = self.base.apply_fp8(layer, ops, x_fp8, x_scale, out_dtype)
        if self.inputs.active:
            self._add(ops, x_fp8, x_scale, y)
        return y

    def _add(
        self, ops: ModuleType, rows: torch.Tensor, scale: torch.Tensor | None, y: torch.Tensor
    ) -> None:
        """Each token's adapter added into y in place; rows: [num_tokens, in] (float8 with
        its scale, or the model dtype)."""
        out = y.view(-1, y.shape[-1])  # [num_tokens, out]
        inputs, num = self.inputs, rows.shape[0]
        slots, order = inputs.slots_for(num), inputs.order_for(num)
        shrunk = ops.lora_shrink(rows, self.lora_a, slots, scale, order)  # [num, slices * rank]
        ops.lora_expand(out, shrunk, self.lora_b, slots, self.slice_bounds, order)

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        return None  # the fused norm + projection kernels would hide LoRA's input

    def fp8_input(self, layer: Linear) -> Fp8Input | None:
        into = self.base.fp8_input(layer)
        # Outlier columns' remainders ride after the input's columns: not what A multiplies.
        return into if into is not None and into.channels is None else None
