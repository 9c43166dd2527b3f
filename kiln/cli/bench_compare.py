"""`kiln bench compare OLD NEW [--tolerance 3%]`: every metric two benchmark records share, in
a table, and exit status 1 when one got worse by more than the tolerance (kiln/bench/compare.py
says what a record is and which way each metric is better)."""

from __future__ import annotations

import argparse
import sys


def add_parser(modes: argparse._SubParsersAction) -> None:
    text = "compare two benchmark records (or a suite run with a baseline); exit 1 on a regression"
    p = modes.add_parser("compare", help=text, description=text)
    p.add_argument("old", help="a kiln bench JSON, a baselines/<gpu>.json, or a suite run's folder")
    p.add_argument("new", help="the same kinds")
    p.add_argument(
        "--tolerance",
        default="3%",
        help="how much worse a metric may get before it counts as a regression (default: 3%%)",
    )
    p.add_argument(
        "--metrics",
        default=None,
        help="comma-separated metric names to judge (e.g. output_tok_s,tpot_ms.p50); the "
        "others are shown but not judged (default: every metric)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.bench.compare import (
        compare,
        format_table,
        is_single_record,
        load_rows,
        parse_tolerance,
    )

    try:
        tolerance = parse_tolerance(args.tolerance)
    except ValueError as exc:
        raise SystemExit(f"error: --tolerance: {exc}") from None
    old, new = load_rows(args.old), load_rows(args.new)
    rows = compare(old, new, is_single_record(args.old) and is_single_record(args.new))
    if not rows:
        print(f"error: {args.old} and {args.new} share no metric", file=sys.stderr)
        return 2
    print(format_table(rows, tolerance))
    judged = set(args.metrics.split(",")) if args.metrics else None
    regressions = [
        c for c in rows if c.regressed(tolerance) and (judged is None or c.metric in judged)
    ]
    shared = len({c.row for c in rows})
    print(
        f"{len(rows)} metrics over {shared} rows; {len(regressions)} regressions beyond "
        f"{tolerance * 100:g}%"
    )
    return 1 if regressions else 0
