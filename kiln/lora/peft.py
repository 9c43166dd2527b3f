"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
as PEFT's save_pretrained writes it for Llama-style models (Llama, Mistral, Qwen2, Qwen3): the
A and B matrices of the q/k/v/o and gate/up/down projections, each B scaled by lora_alpha / r
(rsLoRA: lora_alpha / sqrt(r)). What changes a projection's output in a way these two products
do not (DoRA, biases, modules_to_save, ...) is refused with one line naming it."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch

from kiln.errors import LoRAError

# The projections a Llama-style checkpoint names, by block: LoRA applies to these alone.
ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS

# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (PEFT drops the adapter name).
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$"
)
# adapter_config.json options that change the projection beyond B @ A, each refused: (key, why).
_REFUSED = (
    ("use_dora", "DoRA"),
    ("lora_bias", "a bias on lora_B"),
    ("fan_in_fan_out", "fan_in_fan_out (Conv1D) weights"),
    ("use_qalora", "QA-LoRA"),
    ("alora_invocation_tokens", "activated LoRA"),
    ("layer_replication", "layer_replication"),
    ("trainable_token_indices", "trainable tokens"),
    ("target_parameters", "target_parameters"),
    ("alpha_pattern", "per-module lora_alpha (alpha_pattern)"),
)
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


@dataclass(frozen=True)
class LoRAModule:
    """One projection's adapter: A [rank, in] and B [out, rank] with the scaling folded into B,
    both fp32 on the host (the full checkpoint shapes)."""

    lora_a: torch.Tensor
    lora_b: torch.Tensor

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    name: str
    path: str
    # (layer index, projection name as in PROJECTIONS) -> its matrices
    modules: dict[tuple[int, str], LoRAModule]

    @property
    def max_rank(self) -> int:
        return max((m.rank for m in self.modules.values()), default=0)


def read_peft_adapter(name: str, path: str) -> PeftAdapter:
    """The adapter in directory `path` (LoRAError, one line, if kiln cannot serve it)."""
    directory = os.path.expanduser(path)
    where = f"LoRA adapter {name!r} ({path})"
    if not path or not os.path.isdir(directory):
        raise LoRAError(f"{where}: no such directory")
    config = _read_config(os.path.join(directory, CONFIG_FILE), where)
    weights = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(weights):
        pickled = os.path.isfile(os.path.join(directory, "adapter_model.bin"))
        why = " (adapter_model.bin is a pickle, which kiln does not load)" if pickled else ""
        raise LoRAError(f"{where}: no {WEIGHTS_FILE}{why}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(weights)
    except (SafetensorError, OSError) as exc:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} cannot be read: {exc}") from exc
    return PeftAdapter(name, path, _modules(tensors, config, where))


def _read_config(file: str, where: str) -> dict:
    if not os.path.isfile(file):
        raise LoRAError(f"{where}: no {CONFIG_FILE}")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise LoRAError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise LoRAError(f"{where}: {CONFIG_FILE} is not a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{where}: bias={config.get('bias')!r} is not supported (only 'none')")
    if config.get("modules_to_save"):
        raise LoRAError(
            f"{where}: modules_to_save {config['modules_to_save']} is not supported "
            "(whole modules trained beside the adapter)"
        )
    for key, what in _REFUSED:
        if config.get(key):
            raise LoRAError(f"{where}: {what} is not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoRAError(f"{where}: {CONFIG_FILE} needs a positive {key}, got {value!r}")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise LoRAError(
                f"{where}: targets {', '.join(unknown)}, which the base model has no LoRA "
                f"layer for (kiln applies LoRA to {', '.join(PROJECTIONS)})"
            )
    return config


def _modules(
    tensors: dict[str, torch.Tensor], config: dict, where: str
) -> dict[tuple[int, str], LoRAModule]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key} is not a LoRA A or B of a layer's projection")
        layer, block, proj, half = match.groups()
        allowed = ATTENTION_PROJECTIONS if block == "self_attn" else MLP_PROJECTIONS
        if block not in ("self_attn", "mlp") or proj not in allowed:
            raise LoRAError(
                f"{where}: targets {block}.{proj}, which the base model has no LoRA layer for "
                f"(kiln applies LoRA to {', '.join(PROJECTIONS)})"
            )
        if tensor.dim() != 2:
            raise LoRAError(f"{where}: {key} has shape {tuple(tensor.shape)}, not a matrix")
        halves.setdefault((int(layer), proj), {})[half] = tensor.float()
    alpha = float(config["lora_alpha"])
    rslora = bool(config.get("use_rslora"))
    modules = {}
    for (layer, proj), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"{where}: layers.{layer}.{proj} has no {missing}")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise LoRAError(
                f"{where}: layers.{layer}.{proj}: lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)} differ in rank"
            )
        # PEFT: alpha / r, or alpha / sqrt(r) with rsLoRA (r the module's own: rank_pattern).
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        modules[(layer, proj)] = LoRAModule(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return modules
