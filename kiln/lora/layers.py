"""LoRA inside a projection: the base layer's own method, then each token's adapter (by its
slot) added to the output with one shrink and one expand over the step's packed tokens.

`LoRALinearMethod` wraps the projection's method (bf16/fp32, FP8 or INT4 alike) and offers the
fused norm + projection kernels none of its operands, and no float8 input: LoRA's shrink reads
the unquantized normed input, so the blocks run the norm, then apply (see kiln.models.blocks)."""

from __future__ import annotations

from types import ModuleType

import numpy as np
import torch

from kiln.layers.linear import Fp8Input, FusedOperands, Linear, LinearMethod


class LoRAInputs:
    """Each token's adapter slot for the step (-1: the base model alone), in a persistent device
    buffer every LoRA layer reads the first num_tokens of: its address never changes, so the
    decode CUDA graphs read each step's slots as they read its input ids."""

    def __init__(self, max_num_tokens: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int32, device=device)
        self._host = torch.full((max_num_tokens,), -1, dtype=torch.int32, pin_memory=pin)
        self._host_np = self._host.numpy()
        self._copied = torch.cuda.Event() if pin else None

    def fill(self, request_slots: list[int], num_scheduled: list[int], num_rows: int) -> None:
        """The step's slots: request i's for its num_scheduled[i] tokens (batch order), -1
        for the padding rows up to num_rows (a decode batch padded to a graph's size)."""
        if self._copied is not None:
            self._copied.synchronize()  # the last step's copy has read the host buffer
        n = sum(num_scheduled)
        host = self._host_np
        host[:n] = np.repeat(np.asarray(request_slots, dtype=np.int32), num_scheduled)
        rows = max(n, num_rows)
        host[n:rows] = -1
        self.token_slots[:rows].copy_(self._host[:rows], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


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

    def input_columns(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor:
        return self.base.input_columns(layer, weight)

    def checkpoint_shape(
        self, layer: Linear, param: torch.Tensor, shape: tuple[int, ...]
    ) -> tuple[int, ...]:
        return self.base.checkpoint_shape(layer, param, shape)

    def process_weights_after_loading(self, layer: Linear) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        y = self.base.apply(layer, ops, x)
        rows = x.reshape(-1, x.shape[-1])  # [num_tokens, in]
        out = y.view(-1, y.shape[-1])  # [num_tokens, out]: the expand adds into y itself
        slots = self.inputs.token_slots[: rows.shape[0]]
        shrunk = ops.lora_shrink(rows, self.lora_a, slots)  # [num_tokens, slices * max_rank]
        ops.lora_expand(out, shrunk, self.lora_b, slots, self.slice_bounds)
        return y

    def fused_operands(self, layer: Linear) -> FusedOperands | None:
        return None  # the fused norm + projection kernels would hide LoRA's input

    def fp8_input(self, layer: Linear) -> Fp8Input | None:
        return None  # LoRA's shrink reads the model-dtype input
