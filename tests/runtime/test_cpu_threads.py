"""The CPU thread default: the usable cores (affinity, cgroup quota) less the busy ones, at least
one; the engine takes it on the CPU when --threads is not given, and says so at start-up (with
a word on float16, which the CPU runs slower than float32)."""

from __future__ import annotations

import logging

import pytest
import torch

from kiln.runtime import cpu_threads
from kiln.runtime.cpu_threads import cgroup_cpu_quota, choose_threads


@pytest.mark.parametrize(
    ("cores", "load", "threads"),
    [(2, 0.1, 2), (2, 0.6, 1), (2, 5.4, 1), (2, 16.0, 1), (16, 3.2, 13), (1, 0.0, 1)],
)
def test_threads_are_the_cores_not_busy(cores, load, threads):
    choice = choose_threads(cores, load)
    assert choice.threads == threads
    assert f"{cores} usable core" in choice.reason and f"load {load:.1f}" in choice.reason


def test_the_cgroup_quota_caps_the_cores(tmp_path, monkeypatch):
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    (tmp_path / "cpu.max").unlink()
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(str(tmp_path)) == 1
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    assert cgroup_cpu_quota(str(tmp_path)) is None
    monkeypatch.setattr(cpu_threads, "cgroup_cpu_quota", lambda: 1)
    assert cpu_threads.usable_cores() == 1


def test_the_engine_takes_the_free_cores_and_logs_its_start(tmp_path, monkeypatch, caplog):
    from kiln import LLM
    from tests.conftest import build_tiny_hf_model

    build_tiny_hf_model("llama-gqa", str(tmp_path))
    monkeypatch.setattr(cpu_threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(cpu_threads.os, "getloadavg", lambda: (5.4, 5.0, 4.0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with caplog.at_level(logging.INFO, logger="kiln.startup"):
            LLM(str(tmp_path), device="cpu", kv_cache_memory_gb=0.01)
        assert torch.get_num_threads() == 1  # 2 cores, both busy: one thread, not torch's 2
        lines = [r.getMessage() for r in caplog.records if r.name == "kiln.startup"]
        assert any(line.startswith("model: ") and str(tmp_path) in line for line in lines)
        assert "device cpu, dtype float32, KV cache float32" in lines
        assert "CPU threads: 1 (2 usable cores, 1-minute load 5.4; --threads N chooses)" in lines
        assert any(line.startswith("memory plan: weights") for line in lines)
        assert any(line.startswith("KV cache: ") and " tokens (" in line for line in lines)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="kiln.startup"):
            LLM(str(tmp_path), device="cpu", kv_cache_memory_gb=0.01, num_threads=2)
        assert torch.get_num_threads() == 2
        assert "CPU threads: 2 (--threads)" in [r.getMessage() for r in caplog.records]
    finally:
        torch.set_num_threads(before)


def test_half_on_the_cpu_is_said_to_be_slower(tmp_path, caplog):
    from kiln import LLM
    from tests.conftest import build_tiny_hf_model

    build_tiny_hf_model("llama-gqa", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="kiln"):
        LLM(str(tmp_path), device="cpu", dtype="float16", kv_cache_memory_gb=0.01, num_threads=1)
    assert any("float16 on the CPU runs slower" in r.getMessage() for r in caplog.records)
