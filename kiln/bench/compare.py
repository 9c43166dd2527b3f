"""Two benchmark records side by side: every metric they share, its change, and whether it got
worse by more than a tolerance. A record is a `kiln bench` JSON (`{"kiln": {metrics}}`), a
baseline file (`benchmarks/baselines/<gpu>.json`: `{"rows": {name: {"record": {"metrics"}}}}`)
or a suite run's folder (one `kiln bench` JSON per row, named after the row). Which way is better
follows from a metric's name: rates (tok/s, fractions of a roofline) up, times (ms, s) down;
a metric of neither kind is shown, not judged."""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass

HIGHER_BETTER = ("tok_s", "req_s", "per_s", "throughput", "roofline_fraction", "gb_s", "tflop")
LOWER_BETTER = ("_ms", "_s", "latency", "seconds", "time")


def direction(metric: str) -> int:
    """+1 when higher is better, -1 when lower is, 0 when the name does not say."""
    head = metric.split(".")[0]
    if any(word in head for word in HIGHER_BETTER):
        return 1
    if any(head.endswith(word) or word in head for word in LOWER_BETTER):
        return -1
    return 0


def _flatten(metrics: dict, prefix: str = "") -> dict[str, float]:
    out: dict[str, float] = {}
    for key, value in metrics.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def load_rows(path: str) -> dict[str, dict[str, float]]:
    """{row name: {metric: value}} of a record, a baseline file or a suite run's folder. A
    single record's row is its file name without `.json`."""
    if os.path.isdir(path):
        rows: dict[str, dict[str, float]] = {}
        for file in sorted(glob.glob(os.path.join(path, "*.json"))):
            rows.update(load_rows(file))
        return rows
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        return {}
    if isinstance(data.get("rows"), dict):
        return {
            name: _flatten(entry["record"].get("metrics") or {})
            for name, entry in data["rows"].items()
            if isinstance(entry, dict) and isinstance(entry.get("record"), dict)
        }
    if isinstance(data.get("kiln"), dict):
        return {os.path.basename(path).removesuffix(".json"): _flatten(data["kiln"])}
    return {}  # a product benchmark's own JSON: not a kiln bench record


@dataclass(frozen=True)
class Comparison:
    row: str
    metric: str
    old: float
    new: float
    direction: int

    @property
    def change(self) -> float | None:
        return None if self.old == 0 else self.new / self.old - 1.0

    def regressed(self, tolerance: float) -> bool:
        change = self.change
        return change is not None and self.direction * change < -tolerance

    def verdict(self, tolerance: float) -> str:
        change = self.change
        if self.direction == 0 or change is None:
            return "-"
        if self.regressed(tolerance):
            return "REGRESSION"
        return "better" if self.direction * change > tolerance else "ok"


def is_single_record(path: str) -> bool:
    """A `kiln bench` JSON file (not a baseline file or a folder)."""
    if os.path.isdir(path):
        return False
    with open(path) as f:
        data = json.load(f)
    return isinstance(data, dict) and isinstance(data.get("kiln"), dict)


def compare(
    old: dict[str, dict[str, float]], new: dict[str, dict[str, float]], pair_singles: bool = False
) -> list[Comparison]:
    """Every (row, metric) both hold, in the old record's order. Rows pair by name; with
    `pair_singles`, two single records pair whatever their file names."""
    if pair_singles and len(old) == 1 and len(new) == 1:
        new = {next(iter(old)): next(iter(new.values()))}
    return [
        Comparison(row, metric, value, new[row][metric], direction(metric))
        for row, metrics in old.items()
        if row in new
        for metric, value in metrics.items()
        if metric in new[row]
    ]


def parse_tolerance(text: str) -> float:
    """'3%' or '0.03' -> 0.03."""
    value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    if not 0 <= value < 1:
        raise ValueError(f"the tolerance must be in [0%, 100%), got {text!r}")
    return value


def format_table(rows: list[Comparison], tolerance: float) -> str:
    header = ("row", "metric", "old", "new", "change", "verdict")
    lines = [header]
    for c in rows:
        change = "n/a" if c.change is None else f"{c.change * 100:+.1f}%"
        lines.append(
            (c.row, c.metric, f"{c.old:.4g}", f"{c.new:.4g}", change, c.verdict(tolerance))
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join(
        "  ".join(
            cell.ljust(w) if i < 2 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(line, widths))
        )
        for line in lines
    )
