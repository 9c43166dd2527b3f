"""builder.weights writes an engine directory from the model's tensors alone: an INT4 model whose
codes were re-laid for the sm_90 kernel after loading (kiln.layers.quantization.int4 keeps only
that copy) writes the same bytes as one that kept kiln's layout, whole and cut per tensor rank.
The relay is forced on the CPU (int4.relays_codes)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kiln import LLM
from kiln.builder.weights import engine_tensors, write_rank_shards, write_weights
from kiln.distributed.parallel_state import ParallelContext
from kiln.layers.quantization import int4, linear_method_factory
from kiln.layers.quantization.int4 import Int4LinearMethod
from kiln.models.base import CausalLM
from kiln.models.llama import LlamaForCausalLM

DATA = Path(__file__).parents[1] / "data" / "int4_checkpoints"
ARGS = dict(kv_cache_memory_gb=0.02, max_num_seqs=2, dtype="float32")


def _relayed(relay: bool, make: Callable[[], object]):
    """make(), with every INT4 layer's codes re-laid after loading where `relay`."""
    with pytest.MonkeyPatch.context() as patch:
        if relay:
            patch.setattr(int4, "relays_codes", lambda device, k, group_size: True)
        return make()


def _int4_layers(model: CausalLM) -> list:
    return [m for m in model.modules() if isinstance(getattr(m, "method", None), Int4LinearMethod)]


def _files(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}  # fmt: skip


def test_a_relaid_int4_model_writes_the_engine_a_plain_one_does(tmp_path) -> None:
    """GPTQ with act-order: the codes are reordered, then re-laid; the engine holds the
    reordered codes in kiln's layout either way."""
    written = {}
    for relay in (False, True):
        llm = _relayed(relay, lambda: LLM(str(DATA / "gptq_desc_act"), **ARGS))
        model = llm.engine.executor.runner.model
        layers = _int4_layers(model)
        assert layers and all((m.weight_mma is not None) == relay for m in layers)
        if relay:  # one copy of the codes: the original layout's is empty
            assert all(m.weight.numel() == 0 for m in layers)
        directory = tmp_path / str(relay)
        directory.mkdir()
        write_weights(engine_tensors(model), str(directory))
        written[relay] = _files(directory)
    assert written[True] == written[False]
    assert any(name.endswith(".safetensors") for name in written[True])


def _rank_shards(relay: bool, source: Path, directory: Path) -> dict[str, bytes]:
    """write_rank_shards of a dummy INT4 model at TP 2, the codes re-laid where `relay`."""
    llm = _relayed(relay, lambda: LLM(str(source), load_format="dummy", quantization="int4-g128",
                                      **ARGS))  # fmt: skip
    model = llm.engine.executor.runner.model
    assert all((m.weight_mma is not None) == relay for m in _int4_layers(model))  # dummy too
    cfg = model.config
    parts: list[CausalLM] = []

    def make(ctx: ParallelContext) -> CausalLM:
        part = LlamaForCausalLM(cfg, cfg.max_position_embeddings,
                                linear_method_factory("int4-g128"), torch.float32, ctx)  # fmt: skip
        parts.append(part)
        return part

    directory.mkdir()
    _relayed(relay, lambda: write_rank_shards(model, 2, str(directory), make))
    assert len(parts) == 2
    assert all((m.weight_mma is not None) == relay for p in parts for m in _int4_layers(p))
    return _files(directory)


def test_a_relaid_int4_model_writes_the_same_rank_shards(tmp_path) -> None:
    """`kiln build -tp 2`'s writer: each rank model loads the whole model's engine tensors (put
    back in kiln's layout), cuts them, re-lays its part and writes it back."""
    config = json.loads((DATA / "gptq" / "config.json").read_text())
    del config["quantization_config"]
    # Wide enough that a rank's o_proj inputs are a whole group of 128.
    config.update(hidden_size=256, intermediate_size=512, head_dim=64)
    (tmp_path / "config.json").write_text(json.dumps(config))
    relaid = _rank_shards(True, tmp_path, tmp_path / "relaid")
    assert relaid == _rank_shards(False, tmp_path, tmp_path / "plain")
    assert sum(name.endswith(".safetensors") for name in relaid) == 2
