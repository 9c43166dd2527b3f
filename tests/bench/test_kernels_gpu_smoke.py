"""benchmarks/kernels_gpu.py's tiny smoke run under the Triton interpreter: every row kind
(the default set and --long) still builds its inputs and runs, so a changed kernel signature or
shape record breaks here, not on the GPU (a --long run once crashed there on a new field)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize(
    ("flags", "kernels"),
    [
        (
            [],
            {"prefill", "decode", "lora", "moe_decode", "moe_grouped_fp8", "moe_route", "moe_int4"},
        ),
        (["--long"], {"prefill_long", "decode_long"}),
        (["--only", "mla"], {"mla_decode"}),
        (["--only", "int8"], {"int8_w8a8"}),
        (["--only", "decode256"], {"decode256"}),
    ],
    ids=["default", "long", "mla", "int8", "decode256"],
)
def test_the_tiny_run_writes_every_row(tmp_path, flags, kernels) -> None:
    out = tmp_path / "kernels.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kernels_gpu.py"), str(out), "--tiny", *flags],
        env=env, capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert kernels <= {row["kernel"] for row in rows}
