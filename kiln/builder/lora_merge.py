"""`kiln build --lora PATH`: one PEFT LoRA adapter merged into the source's weights,
W += scaling * B @ A on each projection it targets, before anything else of the build sees them
(smoothing, calibration, quantization, fusion into qkv_proj / gate_up_proj).

The merged source is written beside the build as a plain HF directory, and the build runs from it:
its calibration and its accuracy check's reference are then the merged model's, not the base's.
The adapter is read as PEFT writes it (`adapter_config.json` + `adapter_model.safetensors`; never a
pickle); what this merge cannot honour (DoRA, biases, modules_to_save, embedding adapters) is
refused in one line, as are targets the base lacks and shapes it does not have."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.checkpoint.file_hash import hash_files
from kiln.errors import BuildError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."  # PEFT's module names, over the HF model's own
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<side>[AB])\.weight")


@dataclass(frozen=True)
class MergeAdapter:
    """One adapter, read and checked against itself (the base is checked when merging)."""

    path: str
    digest: str  # blake2b over the adapter's two files: names the engine
    rank: int
    alpha: float
    use_rslora: bool
    alpha_pattern: dict[str, float]
    ranks: dict[str, int]  # HF module name ("model.layers.0.self_attn.q_proj") -> its rank

    @property
    def modules(self) -> list[str]:
        return sorted(self.ranks)

    def scaling(self, module: str) -> float:
        """PEFT's: alpha / r (rsLoRA: alpha / sqrt(r)), alpha_pattern's alpha where one matches;
        r is the module's own (rank_pattern may change it), read from its tensors."""
        alpha = self.alpha
        for pattern, value in self.alpha_pattern.items():
            if re.match(rf"(.*\.)?({pattern})$", module):
                alpha = value
                break
        rank = self.ranks[module]
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def manifest_entry(self) -> dict:
        """What the engine's manifest records of it."""
        return {
            "name": os.path.basename(os.path.normpath(self.path)),
            "blake2b": self.digest,
            "rank": self.rank,
            "lora_alpha": self.alpha,
            "use_rslora": self.use_rslora,
            "modules": len(self.modules),
        }


def read_adapter(path: str) -> MergeAdapter:
    """The adapter at `path`, its config and tensors checked; BuildError naming what is wrong."""
    path = os.path.expanduser(path)
    config_file = os.path.join(path, CONFIG_FILE)
    weights_file = os.path.join(path, WEIGHTS_FILE)
    for file in (config_file, weights_file):
        if not os.path.isfile(file):
            hint = " (a .bin adapter is a pickle: kiln reads safetensors only)" * (
                file == weights_file and os.path.isfile(os.path.join(path, "adapter_model.bin"))
            )
            raise BuildError(f"--lora {path}: no {os.path.basename(file)}{hint}")
    try:
        with open(config_file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as exc:
        raise BuildError(f"--lora {path}: {CONFIG_FILE} is not readable JSON ({exc})") from None
    _check_config(path, config)
    ranks: dict[str, int] = {}
    with safe_open(weights_file, framework="pt") as f:
        shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}  # noqa: SIM118
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        found = _KEY.fullmatch(key)
        if found is None or not found["module"].startswith(_PREFIX) or len(shape) != 2:
            raise BuildError(
                f"--lora {path}: tensor {key} is not a linear layer's lora_A / lora_B weight "
                "(embedding adapters, biases and DoRA are not merged)"
            )
        pairs.setdefault(found["module"][len(_PREFIX) :], {})[found["side"]] = shape
    for module, sides in pairs.items():
        if set(sides) != {"A", "B"}:
            raise BuildError(f"--lora {path}: {module} has lora_{set('AB') - set(sides)} missing")
        (rank, _), (_, b_rank) = sides["A"], sides["B"]
        if rank != b_rank:
            raise BuildError(
                f"--lora {path}: {module}'s lora_A rank {rank} != its lora_B's {b_rank}"
            )
        ranks[module] = rank
    if not ranks:
        raise BuildError(f"--lora {path}: {WEIGHTS_FILE} holds no LoRA weights")
    root = hashlib.blake2b(digest_size=32)
    for file, digest in zip((CONFIG_FILE, WEIGHTS_FILE), hash_files([config_file, weights_file])):
        root.update(f"{file}\0{digest.size}\0{digest.blake2b}\n".encode())
    return MergeAdapter(
        path=path,
        digest=root.hexdigest(),
        rank=int(config.get("r", max(ranks.values()))),
        alpha=float(config.get("lora_alpha", 8)),
        use_rslora=bool(config.get("use_rslora", False)),
        alpha_pattern={str(k): float(v) for k, v in (config.get("alpha_pattern") or {}).items()},
        ranks=ranks,
    )


def _check_config(path: str, config: object) -> None:
    if not isinstance(config, dict):
        raise BuildError(f"--lora {path}: {CONFIG_FILE} is not a JSON object")
    refusals = (
        (config.get("peft_type", "LORA") != "LORA", f"peft_type {config.get('peft_type')!r}"),
        (bool(config.get("use_dora")), "DoRA (use_dora)"),
        (config.get("bias", "none") != "none", f"bias {config.get('bias')!r}"),
        (bool(config.get("modules_to_save")), "modules_to_save"),
        (bool(config.get("fan_in_fan_out")), "fan_in_fan_out (GPT-2's Conv1D layers)"),
    )
    for refused, what in refusals:
        if refused:
            raise BuildError(f"--lora {path}: {what} is not supported (plain LoRA only)")


@contextlib.contextmanager
def merged_source(source: str, adapter: MergeAdapter | None, beside: str) -> Iterator[str]:
    """The directory a build reads: `source` itself, or (with an adapter) the source with it
    merged, written next to `beside` (the engine's target, on the same disk) and removed after."""
    if adapter is None:
        yield source
        return
    merged = f"{beside}.lora-{os.getpid()}"
    shutil.rmtree(merged, ignore_errors=True)
    try:
        merge_into(source, adapter, merged)
        yield merged
    finally:
        shutil.rmtree(merged, ignore_errors=True)


def merge_into(source: str, adapter: MergeAdapter, out: str) -> None:
    """Write `source` (an HF directory) into `out` with the adapter merged into its weights;
    every other file is copied. Each target must be a 2-D weight of the source whose shape is
    lora_B's rows by lora_A's columns."""
    if not os.path.isdir(source):
        raise BuildError(f"--lora needs a Hugging Face directory as the source, got {source}")
    shards = sorted(n for n in os.listdir(source) if n.endswith(".safetensors"))
    where: dict[str, str] = {}
    for shard in shards:
        with safe_open(os.path.join(source, shard), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                where[key] = shard
    weights_file = os.path.join(adapter.path, WEIGHTS_FILE)
    with safe_open(weights_file, framework="pt") as f:
        deltas = {
            m: tuple(f.get_tensor(f"{_PREFIX}{m}.lora_{side}.weight") for side in "AB")
            for m in adapter.modules
        }
    by_shard: dict[str, list[str]] = {}
    for module in adapter.modules:
        weight = f"{module}.weight"
        if weight not in where:
            raise BuildError(
                f"--lora {adapter.path}: it targets {module}, which the base model does not have"
            )
        by_shard.setdefault(where[weight], []).append(module)
    os.makedirs(out, exist_ok=True)
    for name in sorted(os.listdir(source)):
        if name not in by_shard and os.path.isfile(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    for shard, modules in by_shard.items():
        with safe_open(os.path.join(source, shard), framework="pt") as f:
            tensors = {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
            metadata = f.metadata()
        for module in modules:
            a, b = deltas[module]
            tensors[f"{module}.weight"] = _merged(
                tensors[f"{module}.weight"], a, b, adapter.scaling(module), module, adapter.path
            )
        save_file(tensors, os.path.join(out, shard), metadata=metadata or {"format": "pt"})


def _merged(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, module: str, path: str
) -> torch.Tensor:
    """W + scaling * B @ A, summed in float32 and cast back to W's dtype."""
    # weight: [out, in]; a: [r, in]; b: [out, r]
    if weight.dim() != 2 or weight.shape != (b.shape[0], a.shape[1]):
        raise BuildError(
            f"--lora {path}: {module} is {list(a.shape[1:])} -> {list(b.shape[:1])} in the "
            f"adapter, but the base model's weight is {list(weight.shape)} ([out, in])"
        )
    if not weight.is_floating_point() or weight.element_size() < 2:
        raise BuildError(
            f"--lora {path}: {module}'s weight is {weight.dtype}: merge into a quantized "
            "checkpoint is not supported (build from the unquantized model)"
        )
    delta = scaling * (b.float() @ a.float())
    return (weight.float() + delta).to(weight.dtype)
