"""Reading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`),
as PEFT's save_pretrained writes it: each targeted linear layer's A and B, B scaled as PEFT
scales it, lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)) with the module's own alpha from
alpha_pattern and its own r (rank_pattern: its tensors' rank). `read_peft_modules` gives them by
the base model's module name (what `kiln build --lora` merges); `read_peft_adapter` keeps a
Llama-style model's q/k/v/o and gate/up/down projections by layer (what the engine serves).
What changes a projection's output in a way these two products do not (DoRA, biases,
modules_to_save, ...) is refused with one line naming it."""

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
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<side>[AB])\.weight$")
# A decoder layer's projection, by module name: model.layers.3.self_attn.q_proj.
_PROJECTION = re.compile(r"^(?:model\.)?layers\.(\d+)\.(\w+)\.(\w+)$")
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
class PeftModules:
    """An adapter's matrices by the base model's module name ("model.layers.3.self_attn.q_proj":
    PEFT's, without its base_model.model. prefix), and its adapter_config.json."""

    config: dict
    modules: dict[str, LoRAModule]


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
    """The adapter in directory `path` as the engine serves it: each decoder layer's projection
    (LoRAError, one line, if kiln cannot serve it)."""
    where = f"LoRA adapter {name!r} ({path})"
    read = read_peft_modules(path, where)
    targets = read.config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(PROJECTIONS))
        if unknown:
            raise LoRAError(
                f"{where}: targets {', '.join(unknown)}, which the base model has no LoRA "
                f"layer for (kiln applies LoRA to {', '.join(PROJECTIONS)})"
            )
    modules: dict[tuple[int, str], LoRAModule] = {}
    for module, matrices in read.modules.items():
        match = _PROJECTION.match(module)
        block, proj = (match.group(2), match.group(3)) if match else ("", module)
        allowed = ATTENTION_PROJECTIONS if block == "self_attn" else MLP_PROJECTIONS
        if match is None or block not in ("self_attn", "mlp") or proj not in allowed:
            raise LoRAError(
                f"{where}: targets {module}, which the base model has no LoRA layer for "
                f"(kiln applies LoRA to {', '.join(PROJECTIONS)})"
            )
        modules[(int(match.group(1)), proj)] = matrices
    return PeftAdapter(name, path, dict(sorted(modules.items())))


def read_peft_modules(path: str, where: str) -> PeftModules:
    """Every module's matrices of the adapter in directory `path`, B scaled as PEFT scales it
    (LoRAError, one line starting with `where`, if the adapter is unreadable or is more than
    LoRA)."""
    directory = os.path.expanduser(path)
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
    return PeftModules(config, _modules(tensors, config, where))


def module_alpha(config: dict, module: str) -> float:
    """A module's lora_alpha: alpha_pattern's value for the first pattern matching the end of
    its name (PEFT's get_pattern_key), else lora_alpha."""
    for pattern, alpha in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return float(alpha)
    return float(config["lora_alpha"])


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
    for key in ("alpha_pattern", "rank_pattern"):
        pattern = config.get(key) or {}
        if not isinstance(pattern, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for v in pattern.values()
        ):
            raise LoRAError(f"{where}: {CONFIG_FILE}'s {key} must map names to positive numbers")
    return config


def _modules(tensors: dict[str, torch.Tensor], config: dict, where: str) -> dict[str, LoRAModule]:
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoRAError(f"{where}: tensor {key} is not a linear layer's lora_A or lora_B")
        if tensor.dim() != 2:
            raise LoRAError(f"{where}: {key} has shape {tuple(tensor.shape)}, not a matrix")
        halves.setdefault(match["module"], {})[match["side"]] = tensor.float()
    rslora = bool(config.get("use_rslora"))
    modules = {}
    for module, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise LoRAError(f"{where}: {module} has no {missing}")
        a, b = pair["A"], pair["B"]
        rank = a.shape[0]
        if b.shape[1] != rank:
            raise LoRAError(
                f"{where}: {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                "differ in rank"
            )
        # PEFT: alpha / r, or alpha / sqrt(r) with rsLoRA; the module's own alpha
        # (alpha_pattern) and r (rank_pattern, which its tensors' shapes carry).
        alpha = module_alpha(config, module)
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        modules[module] = LoRAModule(a.contiguous(), (b * scaling).contiguous())
    if not modules:
        raise LoRAError(f"{where}: {WEIGHTS_FILE} holds no LoRA weights")
    return modules
