"""`kiln build --lora PATH`: one PEFT LoRA adapter merged into the source's weights,
W += scaling * B @ A on each projection it targets, before anything else of the build sees them
(smoothing, calibration, quantization, fusion into qkv_proj / gate_up_proj).

The merged source is written beside the build as a plain HF directory, and the build runs from it:
its calibration and its accuracy check's reference are then the merged model's, not the base's.
The adapter is read by the engine's own reader (kiln.lora.peft.read_peft_modules: PEFT's format,
never a pickle, each module scaled as PEFT scales it, alpha_pattern and rank_pattern included);
what it cannot honour (DoRA, biases, modules_to_save, embedding adapters) is refused in one
line, as are targets the base lacks and shapes it does not have."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.checkpoint.file_hash import hash_files
from kiln.errors import BuildError, LoRAError
from kiln.lora.peft import CONFIG_FILE, WEIGHTS_FILE, LoRAModule, read_peft_modules


@dataclass(frozen=True)
class MergeAdapter:
    """One adapter, read and checked against itself (the base is checked when merging)."""

    path: str
    digest: str  # blake2b over the adapter's two files: names the engine
    rank: int
    alpha: float
    use_rslora: bool
    # HF module name ("model.layers.0.self_attn.q_proj") -> A and B, B scaled as PEFT scales it.
    matrices: dict[str, LoRAModule] = field(repr=False)

    @property
    def modules(self) -> list[str]:
        return sorted(self.matrices)

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
    try:
        read = read_peft_modules(path, f"--lora {path}")
    except LoRAError as exc:
        raise BuildError(str(exc)) from None
    files = [os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)]
    root = hashlib.blake2b(digest_size=32)
    for file, digest in zip((CONFIG_FILE, WEIGHTS_FILE), hash_files(files)):
        root.update(f"{file}\0{digest.size}\0{digest.blake2b}\n".encode())
    config = read.config
    return MergeAdapter(
        path=path,
        digest=root.hexdigest(),
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        use_rslora=bool(config.get("use_rslora", False)),
        matrices=read.modules,
    )


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
            pair = adapter.matrices[module]
            tensors[f"{module}.weight"] = _merged(
                tensors[f"{module}.weight"], pair.lora_a, pair.lora_b, module, adapter.path
            )
        save_file(tensors, os.path.join(out, shard), metadata=metadata or {"format": "pt"})


def _merged(
    weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, module: str, path: str
) -> torch.Tensor:
    """W + B @ A (B scaled), summed in float32 and cast back to W's dtype."""
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
    delta = b.float() @ a.float()
    return (weight.float() + delta).to(weight.dtype)
