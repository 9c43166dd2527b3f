"""`kiln bench` on the CPU with a tiny model: both modes, with the HF baseline, write a record."""

from __future__ import annotations

import json
import pathlib

import pytest

from kiln.cli.main import main
from tests.conftest import build_tiny_hf_model

_REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    build_tiny_hf_model("llama-gqa", str(path))
    return str(path)


def test_bench_throughput_with_hf_baseline(tiny_dir, tmp_path):
    out = tmp_path / "tp.json"
    args = ["bench", "throughput", "--model", tiny_dir, "--num-requests", "6",
            "--input-len", "4:20", "--output-len", "3:9", "--baseline", "hf", "--no-progress",
            "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    kiln, hf = record["kiln"], record["hf"]
    # Every requested token is counted, on both sides, for the same seeded workload.
    assert kiln["num_requests"] == hf["num_requests"] == 6
    assert kiln["output_tokens"] == hf["output_tokens"]
    assert kiln["output_tok_s"] > 0
    # Latency percentiles travel in the same JSON as the rates (both sides of a long-prompt mix).
    for metric in ("ttft", "tpot"):
        stats = kiln[metric]
        assert 0 < stats["p50_ms"] <= stats["p90_ms"] <= stats["p99_ms"]
    assert "tpot" not in hf  # generate returns a batch at once: no per-token timing to report
    assert record["speedup_vs_hf"]["output_tok_s"] == pytest.approx(
        kiln["output_tok_s"] / hf["output_tok_s"]
    )
    assert record["env"]["git_revision"] and record["memory_plan"]["kv_blocks"] > 0


def test_bench_latency_reports_decode_rate_and_roofline(tiny_dir, tmp_path):
    out = tmp_path / "lat.json"
    args = ["bench", "latency", "--model", tiny_dir, "--num-requests", "2", "--input-len", "16",
            "--output-len", "8", "--baseline", "hf", "--no-progress",
            "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    assert record["kiln"]["decode_tok_s"] > 0 and record["hf"]["decode_tok_s"] > 0
    assert record["roofline"]["achieved_fraction"] > 0


def test_bench_kv_cache_dtype_flag_reaches_the_engine_and_the_roofline(tiny_dir, tmp_path):
    """--kv-cache-dtype fp8 is recorded, sizes the plan in float8, and shrinks the KV bytes the
    decode roofline counts (fp32 -> float8: a quarter)."""
    records = {}
    for kv in ("auto", "fp8"):
        out = tmp_path / f"lat_{kv}.json"
        args = ["bench", "latency", "--model", tiny_dir, "--num-requests", "1",
                "--input-len", "64", "--output-len", "4", "--kv-cache-dtype", kv,
                "--kv-cache-memory-gb", "0.01", "--no-progress",
                "--output-json", str(out)]  # fmt: skip
        assert main(args) == 0
        records[kv] = json.loads(out.read_text())
    auto, fp8 = records["auto"], records["fp8"]
    assert fp8["engine_config"]["kv_cache_dtype"] == "fp8"
    assert auto["memory_plan"]["kv_dtype"] == "float32"
    assert fp8["memory_plan"]["kv_dtype"] == "float8_e4m3fn"
    # The same budget holds four times the blocks (up to the budget's rounding to whole blocks).
    assert fp8["memory_plan"]["kv_blocks"] // 4 == auto["memory_plan"]["kv_blocks"]
    kv_auto = auto["roofline"]["bytes_per_step"] - fp8["roofline"]["bytes_per_step"]
    assert kv_auto > 0  # the weights are the same; only the KV share shrank


def test_bench_runs_the_oracle_at_a_set_acceptance_length(tiny_dir, tmp_path):
    """kiln bench's instrument: speculative decoding at a set mean acceptance length on random
    weights, named in the record; with --speculative-config too, refused."""
    out = tmp_path / "oracle.json"
    args = ["bench", "latency", "--model", tiny_dir, "--num-requests", "1", "--input-len", "8",
            "--output-len", "121", "--oracle-acceptance-length", "3", "--warmup", "0",
            "--no-progress", "--output-json", str(out)]  # fmt: skip
    assert main(args) == 0
    record = json.loads(out.read_text())
    spec = record["engine_config"]["speculative_config"]
    assert spec["method"] == "oracle" and spec["instrument"]["accept_by_draw"]
    assert spec["num_speculative_tokens"] == 4
    assert abs(record["kiln"]["spec_decode"]["mean_acceptance_length"] - 3.0) < 0.2
    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert main([*args, "--speculative-config", ngram]) == 2


def test_revision_is_kilns_own_wherever_it_runs(tmp_path, monkeypatch):
    """Run from another git repository (or none), the record names kiln's checkout, not the
    current directory's."""
    import subprocess

    from kiln.bench.report import kiln_revision, kiln_source_hash

    here = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=_REPO
    ).stdout.strip()
    other = tmp_path / "other"
    other.mkdir()
    subprocess.run(["git", "init", "-q", str(other)], check=True)
    monkeypatch.chdir(other)
    assert kiln_revision().removesuffix("-dirty") == here
    assert len(kiln_source_hash()) == 16


def test_a_host_bound_run_says_so():
    from kiln.bench.runner import _table

    def record(busy: float) -> dict:
        graph = {"engine_step_ms": 26.3, "outside_runner_ms": 23.0, "gpu_busy_fraction": busy}
        kiln = {"output_tok_s": 1.0, "total_tok_s": 2.0, "request_s": 0.1}
        return {"mode": "throughput", "kiln": kiln, "step_profile": {"graph": graph}}

    warning = "host-bound: the GPU was busy 36% of a decode step (26.3 ms, 23.0 of them outside"
    assert warning in _table(record(0.36))
    assert "host-bound" not in _table(record(0.99))
    assert "host-bound" not in _table({**record(0.5), "step_profile": {}})  # no graphs (CPU)
