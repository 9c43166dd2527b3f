"""benchmarks/step_trace_waves.py: the waves of a fixed-length throughput run and their lines,
on a step trace whose decode cost is known."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from step_trace_waves import waves

COLUMNS = ["graph", "num_seqs", "num_tokens", "prepare", "forward_launch", "sample_launch",
           "sync_wait", "finish", "gpu", "engine_step"]  # fmt: skip


def _step(graph: bool, seqs: int, gpu_ms: float) -> list:
    return [graph, seqs, seqs if graph else 4096, 0.1, 0.1, 0.1, 0.1, 0.1, gpu_ms, gpu_ms]


def test_waves_fit_each_decode_run_at_the_full_row_count() -> None:
    rows = [_step(False, 16, 200.0) for _ in range(5)]
    rows += [_step(True, 64, 10.0 + 0.02 * i + (0.05 if i % 2 else -0.05)) for i in range(300)]
    rows += [_step(True, 60, 9.0), _step(False, 64, 210.0)]  # the wave's tail, a prefill
    rows += [_step(True, 64, 12.0 + 0.03 * i) for i in range(150)]
    rows += [_step(False, 64, 210.0)] + [_step(True, 64, 99.0) for _ in range(20)]  # too short
    record = {
        "step_trace": {"columns": COLUMNS, "rows": rows},
        "memory_plan": {"kv_gib": 1.0, "kv_tokens": 2**30 // 65536},  # 64 KiB a token
    }
    first, second = waves(record, min_steps=100)
    assert (first.first_step, first.steps, first.rows) == (5, 300, 64)
    assert first.slope_us == pytest.approx(20.0, rel=1e-3)
    assert first.intercept_ms == pytest.approx(10.0, abs=0.01)
    assert first.kv_tb_s == pytest.approx(64 * 65536 / 20e-6 / 1e12, rel=1e-3)
    assert (second.first_step, second.steps) == (307, 150)
    assert second.slope_us == pytest.approx(30.0)
    assert waves(record, min_steps=1000) == []
