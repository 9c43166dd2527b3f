"""`kiln eval --tasks wikitext,gsm8k`: accuracy scores of a model, as lm-evaluation-harness
computes them (trtllm-eval's role), printed as lm-eval's table and optionally written as JSON."""

from __future__ import annotations

import argparse
import json
import os
import sys

from kiln.cli.engine_args import add_engine_args, engine_config_from_args
from kiln.cli.output_file import check_output_file

# A clone sits beside the shared data in CI and on our machines: <repo>/../shared/data.
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_DATA_DIR = os.path.join(os.path.dirname(_REPO_ROOT), "shared", "data")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="score a model on accuracy tasks (wikitext, gsm8k)")
    p.add_argument("--tasks", default="wikitext", help="comma-separated: wikitext, gsm8k")
    p.add_argument("--limit", type=int, default=None, help="first N documents/questions a task")
    p.add_argument("--num-fewshot", type=int, default=None, help="default: the task's (gsm8k 5)")
    p.add_argument("--output-json", default=None, help="write the scores here")
    p.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR if os.path.isdir(DEFAULT_DATA_DIR) else None,
        help="holds wikitext-2/ and gsm8k/ (default: ../shared/data beside the repository)",
    )
    add_engine_args(p)
    p.set_defaults(func=run)


def format_table(results: dict[str, dict[str, float]], num_fewshot: int | None) -> str:
    """lm-eval's markdown results table: one row per (task, metric)."""
    rows = ["|Tasks|n-shot|Metric|Value|", "|---|---|---|---:|"]
    for task, scores in results.items():
        shots = "" if task == "wikitext" else str(5 if num_fewshot is None else num_fewshot)
        for metric, value in scores.items():
            shown = f"{value:.4f}" if isinstance(value, float) else str(value)
            rows.append(f"|{task}|{shots}|{metric}|{shown}|")
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from kiln.eval import get_task

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    modules = {t: get_task(t) for t in tasks}  # an unknown name fails before the model loads
    if args.data_dir is None or not os.path.isdir(args.data_dir):
        where = args.data_dir or DEFAULT_DATA_DIR
        print(f"error: data directory {where} not found: give --data-dir", file=sys.stderr)
        return 2
    if args.output_json:  # before the run: its minutes are not lost to a missing folder
        check_output_file(args.output_json, "--output-json")
    from kiln.llm import LLM

    llm = LLM(**vars(engine_config_from_args(args)))
    results = {
        task: module.run(llm, args.data_dir, limit=args.limit, num_fewshot=args.num_fewshot)
        for task, module in modules.items()
    }
    print(format_table(results, args.num_fewshot))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"model": args.model, "limit": args.limit, "results": results}, f, indent=2)
    return 0
