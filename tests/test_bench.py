"""`kiln bench` on the CPU with a tiny model: both modes, with the HF baseline, write a record."""

from __future__ import annotations

import json

import pytest

from kiln.cli.main import main
from tests.conftest import build_tiny_hf_model


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
    assert kiln["output_tok_s"] > 0 and "p99_ms" in kiln["tpot"]
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
