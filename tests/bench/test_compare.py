"""`kiln bench compare`: every shared metric in a table, the direction of each (rates up, times
down), and exit status 1 on a regression beyond the tolerance; on the recorded baselines, a kiln
bench JSON, and a suite run's folder against a baseline file."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kiln.bench.compare import compare, direction, load_rows, parse_tolerance
from kiln.cli.main import main

BASELINES = Path(__file__).resolve().parents[2] / "benchmarks" / "baselines"


def _write(path: Path, data: dict) -> str:
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize(
    "metric, want",
    [
        ("output_tok_s", 1),
        ("decode_tok_s", 1),
        ("roofline_fraction", 1),
        ("copy_bandwidth_gb_s", 1),
        ("ttft_ms.p99", -1),
        ("tpot_ms.mean", -1),
        ("e2e_s.p50", -1),
        ("num_requests", 0),
    ],
)
def test_direction_follows_the_name(metric, want):
    assert direction(metric) == want


def test_tolerance_spellings():
    assert parse_tolerance("3%") == parse_tolerance("0.03") == 0.03
    with pytest.raises(ValueError):
        parse_tolerance("150%")


def test_a_baseline_against_itself_passes(capsys):
    path = str(BASELINES / "h200.json")
    assert main(["bench", "compare", path, path]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0] for line in out.splitlines()[1:-1]}
    assert rows == {r for r, m in load_rows(path).items() if m}  # every row with a record
    assert "REGRESSION" not in out and "8b_fp8_128x128" in out and "ttft_ms.p99" in out


def test_regressions_in_either_direction_fail_and_name_the_metric(tmp_path, capsys):
    old = json.loads((BASELINES / "h200.json").read_text())
    new = copy.deepcopy(old)
    row = new["rows"]["8b_fp8_128x128"]["record"]["metrics"]
    row["output_tok_s"] *= 0.96  # 4% slower
    old_path, new_path = _write(tmp_path / "old.json", old), _write(tmp_path / "new.json", new)
    assert main(["bench", "compare", old_path, new_path, "--tolerance", "3%"]) == 1
    out = capsys.readouterr().out
    [line] = [line for line in out.splitlines() if "REGRESSION" in line]
    assert line.split()[:2] == ["8b_fp8_128x128", "output_tok_s"] and "-4.0%" in line
    assert main(["bench", "compare", old_path, new_path, "--tolerance", "5%"]) == 0
    row["output_tok_s"] /= 0.96
    row["tpot_ms"]["p50"] *= 1.10  # a time 10% up is worse
    _write(tmp_path / "new.json", new)
    assert main(["bench", "compare", old_path, new_path]) == 1
    regressed = [ln for ln in capsys.readouterr().out.splitlines() if "REGRESSION" in ln]
    assert len(regressed) == 1 and "tpot_ms.p50" in regressed[0]
    assert main(["bench", "compare", old_path, new_path, "--metrics", "output_tok_s"]) == 0


def test_a_suite_run_folder_and_single_records(tmp_path):
    base = json.loads((BASELINES / "h100.json").read_text())
    run = tmp_path / "run"
    run.mkdir()
    metrics = base["rows"]["8b_fp8_batch1_decode"]["record"]["metrics"]
    _write(run / "8b_fp8_batch1_decode.json", {"mode": "latency", "kiln": metrics})
    _write(run / "serve.json", {"rows": "not a kiln bench record"})  # a product benchmark's
    rows = compare(load_rows(str(BASELINES / "h100.json")), load_rows(str(run)))
    assert {c.row for c in rows} == {"8b_fp8_batch1_decode"}
    assert all(c.change == 0 for c in rows)
    # Two single records pair whatever their file names.
    a = _write(tmp_path / "a.json", {"kiln": {"output_tok_s": 100.0, "ttft_ms": {"p50": 10}}})
    b = _write(tmp_path / "b.json", {"kiln": {"output_tok_s": 110.0, "ttft_ms": {"p50": 9}}})
    pairs = compare(load_rows(a), load_rows(b), pair_singles=True)
    verdicts = {c.metric: c.verdict(0.03) for c in pairs}
    assert verdicts == {"output_tok_s": "better", "ttft_ms.p50": "better"}
    assert main(["bench", "compare", a, b]) == 0
    assert main(["bench", "compare", a, str(tmp_path / "run")]) == 2  # nothing shared
