"""The memory plan's recorded activation peak (kiln.runtime.activation_record): an engine built on
a GPU carries its warm-up's profile; a load takes it only when the key is exactly equal, and
profiles as before otherwise. The CPU has no profile step, so the device's memory queries and the
measurement itself are faked at their seams; the arithmetic of the plan is the real one."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from kiln.checkpoint.engine_dir import MANIFEST_FILE, recorded_activation_profile
from kiln.config import EngineConfig
from kiln.models.llama import LlamaForCausalLM
from kiln.runtime import memory_plan
from kiln.runtime.activation_record import (
    kiln_source_digest,
    profile_key,
    resolve_activation_profile,
)
from tests.conftest import tiny_model_config

GiB = 1 << 30
SOFTWARE = {"torch": "2.11.0", "cuda": "13.0", "triton": "3.6.0", "kiln_source": "abc",
            "alloc_conf": "", "gpu_class": "NVIDIA H200", "compute_capability": "9.0"}  # fmt: skip
SHAPES = {"max_num_batched_tokens": 8192, "max_num_seqs": 256, "max_model_len": 131072,
          "block_size": 16, "dtype": "auto", "kv_cache_dtype": "bfloat16",
          "quantization": "none", "lm_head_quantization": "none", "kernels": "triton",
          "tp": [1, 0], "pp": [1, 0], "max_num_logprobs": 5}  # fmt: skip
RECORD = {"peak_bytes": 3 * GiB, "forward_peak_bytes": 2 * GiB, "non_torch_growth_bytes": 1 << 28}


class Measure:
    """The profile step's seam: counts its runs, returns fixed bytes."""

    def __init__(self, result: tuple[int, int, int] = (5 * GiB, 4 * GiB, 1 << 20)) -> None:
        self.calls, self.result = 0, result

    def __call__(self) -> tuple[int, int, int]:
        self.calls += 1
        return self.result


def _record(key: dict) -> dict:
    return json.loads(json.dumps({"key": key, **RECORD}))  # as the manifest stores it


def test_an_equal_key_takes_the_recorded_peak_without_profiling(caplog) -> None:
    key = profile_key("engine-1", SHAPES, SOFTWARE)
    measure = Measure()
    with caplog.at_level(logging.INFO, logger="kiln"):
        profile = resolve_activation_profile(key, _record(key), measure)
    assert measure.calls == 0
    assert profile.source == "recorded"
    assert (profile.peak_bytes, profile.forward_peak_bytes) == (3 * GiB, 2 * GiB)
    assert profile.non_torch_growth_bytes == 1 << 28
    assert "recorded at build" in caplog.text


@pytest.mark.parametrize("part", ["engine_id", *SHAPES, *SOFTWARE, "record_version"])
def test_any_part_of_the_key_differing_profiles_again(part, caplog) -> None:
    key = profile_key("engine-1", SHAPES, SOFTWARE)
    built = dict(key)
    built[part] = "something else"
    measure = Measure()
    with caplog.at_level(logging.INFO, logger="kiln"):
        profile = resolve_activation_profile(key, _record(built), measure)
    assert measure.calls == 1
    assert profile.source == "profiled" and profile.peak_bytes == 5 * GiB
    assert part in caplog.text  # the log names what differs


def test_a_missing_part_or_no_record_profiles_again() -> None:
    key = profile_key("engine-1", SHAPES, SOFTWARE)
    fewer = {k: v for k, v in key.items() if k != "triton"}
    for recorded in (_record(fewer), None, {"key": key}, {"key": key, "peak_bytes": "x"}):
        measure = Measure()
        assert resolve_activation_profile(key, recorded, measure).source == "profiled"
        assert measure.calls == 1
    measure = Measure()  # not an engine directory: nothing to compare with
    assert resolve_activation_profile(None, _record(key), measure).source == "profiled"
    assert measure.calls == 1


def test_the_source_digest_changes_with_kiln_code(tmp_path) -> None:
    from kiln.runtime.activation_record import _source_digest

    (tmp_path / "a.py").write_text("x = 1\n")
    first = _source_digest(str(tmp_path))
    (tmp_path / "a.py").write_text("x = 2\n")
    _source_digest.cache_clear()
    assert _source_digest(str(tmp_path)) != first
    assert len(kiln_source_digest()) == 32


@pytest.fixture
def fake_cuda(monkeypatch) -> Measure:
    """plan_kv_blocks on a pretend 16 GiB device: its memory queries return fixed numbers, the
    profile step is a Measure."""
    measure = Measure()
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (12 * GiB, 16 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 1 * GiB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GiB)
    monkeypatch.setattr(memory_plan, "measure_activation_profile", lambda *a, **k: measure())
    return measure


def _plan(config: EngineConfig, recorded: dict | None, engine_id: str = "engine-1"):
    model = LlamaForCausalLM(tiny_model_config(), max_positions=256)
    return memory_plan.plan_kv_blocks(
        config, model, 256, torch.device("cuda"), torch.float32, engine_id=engine_id,
        recorded_profile=recorded,
    )  # fmt: skip


def test_the_plan_uses_a_build_record_only_under_the_same_key(fake_cuda) -> None:
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512)
    built = _plan(config, None)  # the build's warm-up: profiled, then recorded
    assert fake_cuda.calls == 1 and built.activation_profile.source == "profiled"
    record = json.loads(json.dumps(built.activation_profile.as_record()))

    loaded = _plan(config, record)
    assert fake_cuda.calls == 1, "the recorded peak was not used"
    assert loaded.activation_profile.source == "recorded"
    assert loaded.as_dict()["activation_source"] == "recorded"
    # The same budget as profiling: the peak and what the step adds outside torch, as measured.
    assert loaded.num_blocks == built.num_blocks
    assert loaded.activation_bytes == built.activation_bytes
    assert loaded.graph_reserve_bytes == built.graph_reserve_bytes
    assert loaded.non_torch_bytes == built.non_torch_bytes + (1 << 20)

    for other, engine_id in (
        (EngineConfig(max_num_seqs=16, max_num_batched_tokens=512), "engine-1"),
        (EngineConfig(max_num_seqs=8, max_num_batched_tokens=1024), "engine-1"),
        (EngineConfig(max_num_seqs=8, max_num_batched_tokens=512, block_size=32), "engine-1"),
        (config, "engine-2"),
    ):
        again = _plan(other, record, engine_id)
        assert again.activation_profile.source == "profiled"
    assert fake_cuda.calls == 5


def test_the_record_is_read_from_an_engine_manifest(tmp_path) -> None:
    record = {"key": {"engine_id": "e1"}, **RECORD}
    manifest = {"format_version": 1, "files": {}, "architecture": {}, "dtype": "bfloat16",
                "quantization": "none", "engine_id": "e1",
                "activation_profile": record}  # fmt: skip
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert recorded_activation_profile(str(tmp_path)) == ("e1", record)
    del manifest["activation_profile"]  # built without a GPU
    (tmp_path / MANIFEST_FILE).write_text(json.dumps(manifest))
    assert recorded_activation_profile(str(tmp_path)) == ("e1", None)
    assert recorded_activation_profile(os.path.join(str(tmp_path), "nope")) == (None, None)
    assert recorded_activation_profile(None) == (None, None)


def test_switched_off_by_the_environment_it_profiles(fake_cuda, monkeypatch) -> None:
    from kiln.envs import envs

    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=512)
    record = _plan(config, None).activation_profile.as_record()
    monkeypatch.setenv("KILN_ENGINE_ACTIVATION_RECORD", "0")
    envs.cache_clear()
    try:
        assert _plan(config, record).activation_profile.source == "profiled"
    finally:
        monkeypatch.delenv("KILN_ENGINE_ACTIVATION_RECORD")
        envs.cache_clear()
    assert fake_cuda.calls == 2
