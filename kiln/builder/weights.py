"""Write a loaded model's parameters, as kiln names them (already fused: qkv_proj, gate_up_proj;
quantized ones as their method made them), into safetensors shards of at most 4 GiB + an index.

The bytes depend only on the tensors: fixed shard names, fixed metadata, parameters in
`named_parameters()` order (safetensors orders a file's tensors itself, by dtype and name), and a
key-sorted index, so the same model writes byte-identical files (what the engine cache and its
content addressing rely on), each tensor as its linear method hands it out (engine_tensors: an
INT4 layer whose codes were re-laid for the sm_90 kernel writes them back in kiln's layout).
kiln.checkpoint.engine_dir.iter_engine_weights reads them back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator

import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from kiln.checkpoint.engine_dir import WEIGHT_INDEX_FILE, rank_dir_name
from kiln.distributed.parallel_state import ParallelContext, RankLayout
from kiln.layers.linear import Linear
from kiln.models.base import CausalLM

MAX_SHARD_BYTES = 4 << 30
# One key only: safetensors writes its metadata map in hash order, which differed between two
# builds in one process (CI caught it), so a second key made identical inputs give other bytes.
_METADATA = {"format": "pt"}


def _file_mode() -> int:
    """The mode open() gives a new file here: 0666 less the process's umask."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def engine_tensors(net: CausalLM) -> Iterator[tuple[str, torch.Tensor]]:
    """net's parameters as an engine directory holds them: named_parameters()' names and order,
    a Linear's through its method (LinearMethod.engine_tensor), one at a time."""
    linears = {name: m for name, m in net.named_modules() if isinstance(m, Linear)}
    for name, param in net.named_parameters():
        module, _, attr = name.rpartition(".")
        owner = linears.get(module)
        yield name, param if owner is None else owner.method.engine_tensor(owner, attr, param)


def write_weights(
    params: Iterable[tuple[str, torch.Tensor]],
    directory: str,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> list[str]:
    """Write the shards and the index into `directory`; returns the file names written."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in params:
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        # Host copies, contiguous: safetensors writes raw storage.
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        shard_bytes += nbytes
    names = [f"weights-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map: dict[str, str] = {}
    total = 0
    for shard_name, tensors in tqdm(
        list(zip(names, shards)), desc="writing weights", unit="shard", leave=False
    ):
        save_file(tensors, os.path.join(directory, shard_name), metadata=_METADATA)
        # safetensors writes 0600; the shard is as readable as the engine's other files.
        os.chmod(os.path.join(directory, shard_name), _file_mode())
        for name, tensor in tensors.items():
            weight_map[name] = shard_name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with open(os.path.join(directory, WEIGHT_INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return [*names, WEIGHT_INDEX_FILE]


def write_rank_shards(
    net: CausalLM,
    tp: int,
    directory: str,
    make_rank_model: Callable[[ParallelContext], CausalLM],
) -> list[str]:
    """`kiln build -tp N`: each tensor rank's cut of the built model (the same cut a rank makes
    when it loads the whole engine: CausalLM.load_fused_weights) into rank-R/, each with
    its own shards and index. Returns the file names, relative to `directory`."""
    names = []
    for rank in range(tp):
        part = make_rank_model(ParallelContext(RankLayout(tp, 1, rank), None, None, None))
        part.load_fused_weights(engine_tensors(net))
        sub = rank_dir_name(rank, tp)
        os.makedirs(os.path.join(directory, sub))
        names += [
            f"{sub}/{n}" for n in write_weights(engine_tensors(part), os.path.join(directory, sub))
        ]
        del part
    return names
