"""kiln.bench.metrics: the latency percentiles a throughput record carries beside its rates."""

from __future__ import annotations

import pytest

from kiln.bench.metrics import RequestTiming, throughput_report


def test_throughput_report_has_ttft_and_tpot_percentiles() -> None:
    """100 requests submitted at t=0: request i's first token at (i + 1) ms, then 10 tokens
    (i + 1) / 10 ms apart, so TTFT and TPOT both run 1..100 ms and their percentiles are known."""
    timings = []
    for i in range(100):
        first = (i + 1) / 1000
        gap = first / 10
        timings.append(RequestTiming(0.0, [first + k * gap for k in range(11)], 8))
    report = throughput_report(timings)
    # numpy's linear percentile of 1..100: p50 50.5, p90 90.1, p99 99.01.
    for metric, scale in (("ttft", 1.0), ("tpot", 0.1)):
        stats = report[metric]
        assert stats["p50_ms"] == pytest.approx(50.5 * scale)
        assert stats["p90_ms"] == pytest.approx(90.1 * scale)
        assert stats["p99_ms"] == pytest.approx(99.01 * scale)
        assert stats["mean_ms"] == pytest.approx(50.5 * scale)
    assert report["output_tokens"] == 1100 and report["input_tokens"] == 800
    # The last token of the last request at 100 ms + 10 gaps of 10 ms.
    assert report["duration_s"] == pytest.approx(0.2)
