"""benchmarks/gguf_int_accuracy.py's Q4_K / Q6_K quantizers write blocks gguf.quants reads back
as the values they were given, to within a step of each group."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "gguf_int_accuracy.py"


def _bench():
    spec = importlib.util.spec_from_file_location("gguf_int_accuracy", _PATH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_k_quantizers_round_trip_through_gguf() -> None:
    bench = _bench()
    x = np.random.default_rng(0).normal(0.0, 0.02, (8, 512)).astype(np.float32)
    x[3, 40] = 0.3  # an outlier: its group's step widens, the others' do not
    q4 = dequantize(bench.q4_k(x), GGMLQuantizationType.Q4_K)
    groups = x.reshape(8, -1, 32)
    step = (groups.max(-1) - np.minimum(groups.min(-1), 0)) / 15
    err = np.abs(q4 - x).reshape(groups.shape).max(-1)
    # Half a step, plus the 6-bit scales' and mins' and fp16 d's rounding.
    assert (err <= 0.75 * step + 1e-4).all(), (err / step).max()
    q6 = dequantize(bench.q6_k(x), GGMLQuantizationType.Q6_K)
    groups = x.reshape(8, -1, 16)
    step = np.abs(groups).max(-1) / 32
    block_d = np.abs(x).reshape(8, -1, 256).max(-1) / 32 / 127  # an int8 sub-scale's unit
    err = np.abs(q6 - x).reshape(groups.shape).max(-1)
    # A step (codes -32..31: the peak's opposite clips at 31), plus what a sub-scale rounded by
    # half its unit moves a code of up to 32.
    assert (err <= step + 16 * block_d.repeat(16, -1) + 1e-6).all(), (err / step).max()
