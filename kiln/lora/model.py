"""LoRA on a loaded model: its projections' methods wrapped (kiln.lora.layers), adapters read
into host memory checked against the model, and copied into device slots as the scheduler
places them (SchedulerOutput.lora_loads). The runner's side of kiln.lora.slots."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.errors import LoRAError
from kiln.layers.linear import Linear
from kiln.lora.layers import LoRAInputs, LoRALinearMethod
from kiln.lora.peft import LoRAModule, PeftAdapter, read_peft_adapter
from kiln.lora.request import LoRARequest
from kiln.models.base import CausalLM

# A checkpoint's projection -> (kiln's fused layer under the decoder layer, its slice there).
PROJECTION_LAYERS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_SLICES = {
    "self_attn.qkv_proj": 3,
    "self_attn.o_proj": 1,
    "mlp.gate_up_proj": 2,
    "mlp.down_proj": 1,
}
# Layers whose output the family scales after the checkpoint's weights (folded into them as
# they load: Granite's residual_multiplier), so the adapter's B is scaled alike.
_RESIDUAL_SCALED = ("self_attn.o_proj", "mlp.down_proj")


@dataclass(frozen=True)
class _HostAdapter:
    """An adapter as its slots take it: per wrapped layer (by name), A [slices * max_rank, in]
    and B [out, max_rank] in the model dtype, zero where the adapter has no matrix."""

    request: LoRARequest
    layers: dict[str, tuple[torch.Tensor, torch.Tensor]]


class LoRAModel:
    """The model's LoRA layers, the host copies of the registered adapters, and which adapter
    each device slot holds."""

    def __init__(self, model: CausalLM, max_loras: int, max_rank: int, max_num_tokens: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        # Under pipeline parallelism this stage's layers are layer_start.. of the model's.
        self.num_layers = model.full_config.num_hidden_layers
        start = model.layer_start
        self.dtype = model.dtype
        self.inputs = LoRAInputs(max_num_tokens, model.device)
        self.residual_multiplier = float(getattr(model.config, "residual_multiplier", 1.0))
        self.attention = {
            start + i: getattr(b, "self_attn", None) for i, b in enumerate(model.layers)
        }
        self.methods: dict[str, LoRALinearMethod] = {}  # "layers.3.self_attn.qkv_proj" -> method
        self.linears: dict[str, Linear] = {}
        for i, block in enumerate(model.layers):
            for name, slices in _SLICES.items():
                linear = _submodule(block, name)
                if not isinstance(linear, Linear) or len(linear.output_sizes) != slices:
                    continue  # (a mixture of experts' MLP, an ungated MLP: no LoRA there)
                method = LoRALinearMethod(
                    linear.method, self.inputs, linear, max_loras, max_rank, self.dtype
                )
                linear.method = method
                key = f"layers.{start + i}.{name}"
                self.methods[key], self.linears[key] = method, linear
        if not self.methods:
            raise LoRAError(f"{type(model).__name__} has no projections LoRA applies to")
        self.adapters: dict[int, _HostAdapter] = {}
        self.slot_of: dict[int, int] = {}  # adapter id -> the slot holding it (this runner's view)

    # ---- adapters in host memory -------------------------------------------------------------

    def add_adapter(self, request: LoRARequest) -> None:
        """Read and check an adapter, keep it in host memory (LoRAError, one line, if bad)."""
        adapter = read_peft_adapter(request.lora_name, request.lora_path)
        self.adapters[request.lora_int_id] = _HostAdapter(request, self._host_layers(adapter))

    def remove_adapter(self, lora_int_id: int) -> None:
        self.adapters.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self._clear_slot(slot)

    def _host_layers(self, adapter: PeftAdapter) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        where = f"LoRA adapter {adapter.name!r} ({adapter.path})"
        if adapter.max_rank > self.max_rank:
            raise LoRAError(
                f"{where}: rank {adapter.max_rank} is over max_lora_rank={self.max_rank}"
            )
        layers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for (index, proj), module in adapter.modules.items():
            name, piece = PROJECTION_LAYERS[proj]
            key = f"layers.{index}.{name}"
            if index >= self.num_layers:
                raise LoRAError(
                    f"{where}: targets layers.{index}.{proj}, but the base model has no "
                    f"layers.{index}"
                )
            if not any(k.startswith(f"layers.{index}.") for k in self.linears):
                continue  # another pipeline stage's layer
            linear = self.linears.get(key)
            if linear is None:
                raise LoRAError(
                    f"{where}: targets layers.{index}.{proj}, but the base model has no LoRA "
                    f"layer {name}"
                )
            lora_a, lora_b = _this_ranks_cut(
                linear, piece, module, f"{where}: layers.{index}.{proj}"
            )
            out_size, in_size = linear.output_sizes[piece], linear.in_features
            if key not in layers:
                slices = len(linear.output_sizes)
                layers[key] = (
                    torch.zeros(slices * self.max_rank, in_size, dtype=self.dtype),
                    torch.zeros(linear.out_features, self.max_rank, dtype=self.dtype),
                )
            host_a, host_b = layers[key]
            rank, start = module.rank, sum(linear.output_sizes[:piece])
            factor = self._output_factor(index, name, piece)
            if factor != 1.0:
                lora_b = lora_b * factor
            host_a[piece * self.max_rank : piece * self.max_rank + rank] = lora_a
            host_b[start : start + out_size, :rank] = lora_b
        if self.inputs.token_slots.device.type == "cuda":
            layers = {k: (a.pin_memory(), b.pin_memory()) for k, (a, b) in layers.items()}
        return layers

    def _output_factor(self, index: int, name: str, piece: int) -> float:
        """What the model scaled this projection's output by after the checkpoint (folded into
        its weights), so the adapter's B is scaled alike: Granite's residual multiplier on o
        and down; a float8 KV cache's folded scales on k (1 / k_scale), v (1 / v_scale) and o
        (v_scale: its input is v / v_scale)."""
        factor = self.residual_multiplier if name in _RESIDUAL_SCALED else 1.0
        if getattr(self.attention.get(index), "folded_kv_head_scales", None) is not None:
            raise ValueError(
                "LoRA adapters do not run over per-head (int8) KV-cache scales: an engine built "
                "with --kv-cache-dtype int8 takes none"
            )
        folded = getattr(self.attention.get(index), "folded_kv_scales", None)
        if folded is not None:
            k_scale, v_scale, k_rows = folded
            if name == "self_attn.qkv_proj" and piece == 1 and k_rows:
                factor /= k_scale
            elif name == "self_attn.qkv_proj" and piece == 2:
                factor /= v_scale
            elif name == "self_attn.o_proj":
                factor *= v_scale
        return factor

    # ---- device slots ------------------------------------------------------------------------

    def load_slots(self, loads: list[tuple[int, int]]) -> None:
        """Copy each (slot, adapter id) in place into the slots' rows (stream-ordered after the
        steps already launched, which may still read the slot's old adapter)."""
        for slot, lora_int_id in loads:
            adapter = self.adapters[lora_int_id]
            for old in [i for i, s in self.slot_of.items() if s == slot]:
                del self.slot_of[old]
            for key, method in self.methods.items():
                pair = adapter.layers.get(key)
                if pair is None:
                    method.lora_a[slot].zero_()
                    method.lora_b[slot].zero_()
                else:
                    method.lora_a[slot].copy_(pair[0], non_blocking=True)
                    method.lora_b[slot].copy_(pair[1], non_blocking=True)
            self.slot_of[lora_int_id] = slot

    def _clear_slot(self, slot: int) -> None:
        for method in self.methods.values():
            method.lora_a[slot].zero_()
            method.lora_b[slot].zero_()

    def fill_token_slots(
        self, lora_int_ids: list[int | None], num_scheduled: list[int], num_rows: int
    ) -> None:
        """The step's per-token slots from its requests' adapters (batch order)."""
        slot_of = self.slot_of
        slots = [-1 if i is None else slot_of[i] for i in lora_int_ids]
        self.inputs.fill(slots, num_scheduled, num_rows)


def _this_ranks_cut(
    linear: Linear, piece: int, module: LoRAModule, where: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of one projection as this tensor rank applies them, checked against the whole
    layer's shape. Column-parallel (qkv, gate_up): A whole, B's rows of the rank's output rows.
    Row-parallel (o, down): A's columns of the rank's input columns, B whole; each rank adds
    B (A_r x_r) to its partial output, which the layer's all-reduce then sums to B A x."""
    split = linear.split
    out_full, in_full = linear.output_sizes[piece], linear.in_features
    rows = cols = None
    if split is not None and split.rows is not None:
        assert split.full_sizes is not None  # a column-parallel split has its full sizes
        out_full, rows = split.full_sizes[piece], split.rows[piece]
    elif split is not None and split.cols is not None:
        cols = split.cols
        in_full = cols[1] * split.ctx.tp_size  # query heads and MLP rows split evenly
    a, b = module.lora_a, module.lora_b
    if a.shape[1] != in_full or b.shape[0] != out_full:
        raise LoRAError(
            f"{where} is [{b.shape[0]} x {a.shape[1]}], the base model's is "
            f"[{out_full} x {in_full}]"
        )
    if rows is not None:
        b = b.narrow(0, *rows)
    if cols is not None:
        a = a.narrow(1, *cols)
    return a, b


def _submodule(block: torch.nn.Module, dotted: str) -> torch.nn.Module | None:
    module: torch.nn.Module | None = block
    for part in dotted.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module
