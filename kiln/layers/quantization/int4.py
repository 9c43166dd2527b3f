"""W4A16: 4-bit integer weights with a scale and a zero point per group of inputs (or per output
channel), activations in the model dtype. What GPTQ, AWQ and compressed-tensors `pack-quantized`
checkpoints hold, read into this one layout by kiln.checkpoint.int4_formats; the weights stay
packed on the device (a quarter of bf16's bytes) and are dequantized in the kernel's registers
(ops.int4_linear; a prefill-sized call dequantizes the whole weight once, a transient copy in
the activations' dtype, and runs cuBLAS). Where the sm_90 kernel runs, the codes are re-laid
for it after loading and only that copy stays on the device (every int4_linear kernel reads
it)."""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn

from kiln.errors import ModelLoadError
from kiln.kernels.int4_mma_layout import repack, unrepack
from kiln.kernels.reference import pack_int4, unpack_int4
from kiln.layers.linear import Linear, LinearMethod

SYMMETRIC_ZERO = 8.0  # the zero point of symmetric int4 codes 0..15
DUMMY_SCALE = 0.0025


def relays_codes(device: torch.device, k: int, group_size: int) -> bool:
    """Whether a layer's codes are re-laid for the sm_90 kernel after loading
    (int4_gemm_hopper.usable: an sm_90 GPU, the kernel selected, K and the group size it takes).
    A module-level function, so tests can run the re-laid path on the CPU."""
    if device.type != "cuda":
        return False
    try:
        from kiln.kernels.triton import int4_gemm_hopper
    except ImportError:  # no triton, or one without Gluon
        return False
    return int4_gemm_hopper.usable(device, k, group_size)


class Int4LinearMethod(LinearMethod):
    """weight [out, in / 8] int32 (code 8j + i of a row at bits 4i of word j), weight_scales and
    weight_zeros [out, groups] fp32 (w = (code - zero) * scale; input k in group k // group_size),
    weight_g_idx [in] int32 (a checkpoint's own group of each input, GPTQ's act-order), and
    input_order [in] int64 when that is not k // group_size: after loading, the inputs are
    reordered so that their groups are contiguous, and apply gathers x's columns in that order.
    An engine directory holds the reordered codes and the g_idx, whose order its load restores.

    Under tensor parallelism a column-parallel rank keeps its output rows of the words, scales
    and zeros (and the whole g_idx); a row-parallel rank its input columns: words [start / 8,
    ...), groups [start / group_size, ...) (per-channel scales whole), which must be whole
    groups, and a checkpoint's act-order (desc_act) is refused there (a rank's inputs would
    scatter over every group).

    Where relays_codes holds, process_weights_after_loading re-lays the codes for the sm_90
    kernel (weight_mma [N_pad / 16, 2 * in], int4_mma_layout.repack) and drops the original:
    weight stays a registered parameter (its name, place and device) but empty; what an engine
    directory holds of it (engine_tensor) is unrepack(weight_mma), the same bytes."""

    def __init__(
        self, group_size: int, needs_zeros: bool = True, zero_is_min: bool = False
    ) -> None:
        if group_size < 0 or group_size % 8:
            raise ValueError(
                f"group_size must be a multiple of 8 (0: per channel), got {group_size}"
            )
        self.group_size = group_size  # 0: one group of all inputs
        self.needs_zeros = needs_zeros  # False: symmetric, zeros stay 8 unless loaded
        # True: weight_zeros hold each group's min in weight units, w = code * scale + min
        # (GGUF's blocks, kiln.checkpoint.gguf_int).
        self.weight_unit_mins = zero_is_min
        self._loaded: set[tuple[str, int | None]] = set()
        self._g_idx: torch.Tensor | None = None

    def create_weights(self, layer: Linear, dtype: torch.dtype | None) -> None:
        if layer.split is not None and layer.split.cols is not None:  # row-parallel
            layer.row_parallel_groups(self.group_size or 8, "INT4 weights")  # whole words too
        k, n = layer.in_features, layer.out_features
        group = self.group_size or k
        if k % 8 or k % group:
            raise ModelLoadError(f"INT4: {k} inputs are not whole groups of {group}")

        def param(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        layer.weight = param(torch.zeros(n, k // 8, dtype=torch.int32))
        # A checkpoint's scales replace these; dummy weights keep them: random codes then
        # span +-0.02, about the dummy draw of the other schemes.
        layer.weight_scales = param(torch.full((n, k // group), DUMMY_SCALE))
        layer.weight_zeros = param(torch.full((n, k // group), SYMMETRIC_ZERO))
        layer.weight_g_idx = param(torch.zeros(k, dtype=torch.int32))
        # A buffer, so that moving the layer moves the order too.
        layer.register_buffer("input_order", None, persistent=False)
        # The codes re-laid for the sm_90 kernel where it runs (not saved: an engine holds
        # weight, engine_tensor; kiln.kernels.int4_mma_layout).
        layer.register_buffer("weight_mma", None, persistent=False)
        layer.bias = None
        if layer.has_bias:
            layer.bias = param(torch.empty(n, dtype=dtype))

    def load_checkpoint_tensor(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> None:
        if param is layer.weight_g_idx:  # one per checkpoint projection, not rows of the layer
            if layer.split is not None and layer.split.cols is not None:
                loaded = self._row_parallel_g_idx(layer, loaded)
            if loaded.shape != param.shape:
                raise ModelLoadError(
                    f"INT4 g_idx of shape {tuple(loaded.shape)}, expected {tuple(param.shape)}"
                )
            if self._g_idx is not None and not torch.equal(self._g_idx, loaded.to(self._g_idx)):
                raise ModelLoadError(
                    "INT4: the projections fused into one layer (q/k/v, gate/up) order their "
                    "input groups differently (g_idx); kiln needs one order per input"
                )
            self._g_idx = loaded.to(param.device, torch.int32)
            param.copy_(self._g_idx)
            return
        for name in ("weight", "weight_scales", "weight_zeros", "bias"):
            if param is getattr(layer, name):
                self._loaded.add((name, shard))
        if param.dtype == torch.int32 and loaded.dtype != torch.int32:
            raise ModelLoadError(
                f"INT4 weights must be int32 words, got {loaded.dtype}: kiln does not quantize "
                "to INT4 while loading (load a GPTQ / AWQ / compressed-tensors INT4 checkpoint, "
                "or dummy weights)"
            )
        super().load_checkpoint_tensor(layer, param, shard, loaded)

    def cut(
        self, layer: Linear, param: torch.Tensor, shard: int | None, loaded: torch.Tensor
    ) -> torch.Tensor:
        split = layer.split
        assert split is not None, "Linear.cut cuts only under a split"
        if param is layer.weight_g_idx:  # column-parallel: every input's, whole
            # Row-parallel, an engine's: its columns (only a checkpoint's g_idx reorders
            # inputs, and load_checkpoint_tensor checks and renumbers that one).
            return loaded if split.cols is None else loaded.narrow(0, *layer.row_parallel_cols())
        if split.cols is None:
            return layer.standard_cut(param, shard, loaded)
        if param is layer.weight_scales or param is layer.weight_zeros:
            if not self.group_size:
                return loaded  # per channel: a row's one scale serves every rank's columns
            return loaded.narrow(1, *layer.row_parallel_groups(self.group_size, "INT4 weights"))
        return layer.standard_cut(param, shard, loaded)

    def input_columns(self, layer: Linear, weight: torch.Tensor) -> torch.Tensor:
        """The rank's input columns of packed words [out, in / 8]: 8 codes a word."""
        return weight.narrow(1, *layer.row_parallel_groups(8, "INT4 weights"))

    def _row_parallel_g_idx(self, layer: Linear, g_idx: torch.Tensor) -> torch.Tensor:
        """A row-parallel rank's part of a whole projection's g_idx [in], its groups numbered
        from 0; only the plain order (input k in group k // group_size) cuts into whole groups."""
        start, length = layer.row_parallel_cols()
        full = g_idx.long()
        group = self.group_size or full.numel()
        plain = torch.arange(full.numel(), device=full.device) // group
        if not torch.equal(full, plain):
            raise ModelLoadError(
                "INT4 act-order (desc_act) weights under tensor parallelism: a row-parallel "
                f"rank's inputs ({layer.extra_repr()}) would not hold whole groups; load them "
                "with tensor_parallel_size=1, or a checkpoint quantized without desc_act"
            )
        return (full.narrow(0, start, length) - start // group).to(g_idx.dtype)

    def process_weights_after_loading(self, layer: Linear) -> None:
        shards = [None] if len(layer.output_sizes) == 1 else range(len(layer.output_sizes))
        wanted = ["weight_scales"] + (["weight_zeros"] if self.needs_zeros else [])
        missing = [f"{w}:{s}" for w in wanted for s in shards if (w, s) not in self._loaded]
        if self._loaded and missing:  # an engine's or a dummy model's load nothing through here
            raise ModelLoadError(f"INT4 checkpoint lacks {missing[:3]} of a {layer.extra_repr()}")
        if self._g_idx is None:  # nothing loaded through load_checkpoint_tensor's g_idx
            self._engine_order(layer)
        self._order_inputs(layer)
        self._relay_for_mma(layer)

    def _engine_order(self, layer: Linear) -> None:
        """An engine's act-order layer: its codes were reordered when it was built (as loading
        the checkpoint reorders them) and its g_idx kept, so the input order is g_idx's."""
        if layer.input_order is not None:
            return
        g_idx = layer.weight_g_idx.long()
        order = torch.argsort(g_idx, stable=True)
        if torch.equal(order, torch.arange(g_idx.numel(), device=order.device)):
            return  # groups in input order (or no g_idx: all zeros)
        if layer.split is not None and layer.split.cols is not None:
            raise ModelLoadError(
                "an INT4 act-order (desc_act) engine under tensor parallelism: a row-parallel "
                f"rank's inputs ({layer.extra_repr()}) would not hold whole groups; load it with "
                "tensor_parallel_size=1"
            )
        layer.input_order = order

    def _relay_for_mma(self, layer: Linear) -> None:
        """The codes re-laid for the sm_90 kernel where relays_codes says so, and the original
        layout dropped (one copy on the device; every kernel reads the re-laid one). Runs after
        _order_inputs: the re-laid codes are the reordered ones."""
        weight = layer.weight.data
        k = layer.in_features
        if layer.weight_mma is not None or not relays_codes(weight.device, k, self.group_size or k):
            return
        layer.weight_mma = repack(weight)
        layer.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)

    def engine_tensor(self, layer: Linear, name: str, param: torch.Tensor) -> torch.Tensor:
        if name == "weight" and layer.weight_mma is not None:
            return unrepack(layer.weight_mma, layer.out_features)
        return param

    def _order_inputs(self, layer: Linear) -> None:
        """A checkpoint's act-order (g_idx): the inputs reordered so their groups are contiguous."""
        if self._g_idx is None:
            return
        k, group = layer.in_features, self.group_size or layer.in_features
        order = torch.argsort(self._g_idx.long(), stable=True)
        regular = torch.arange(k, device=order.device) // group
        if not torch.equal(self._g_idx.long()[order], regular):
            raise ModelLoadError(f"INT4 g_idx does not put {group} inputs in each group")
        self._g_idx = None
        if torch.equal(order, torch.arange(k, device=order.device)):
            return  # groups in input order already (desc_act off)
        codes = unpack_int4(layer.weight.data)[:, order]
        layer.weight.data = pack_int4(codes)
        layer.input_order = order

    def apply(self, layer: Linear, ops: ModuleType, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        if layer.input_order is not None:
            x = x.index_select(1, layer.input_order)
        codes = None if layer.weight_mma is not None else layer.weight  # re-laid: the only copy
        y = ops.int4_linear(
            x, codes, layer.weight_scales, layer.weight_zeros, layer.bias, self.weight_unit_mins,
            mma_weight=layer.weight_mma,
        )  # fmt: skip
        return y.reshape(*shape[:-1], y.shape[-1])
