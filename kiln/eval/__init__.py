"""Accuracy tasks for `kiln eval`: one module per task, each with
`run(llm, data_dir, limit=None, num_fewshot=None) -> dict[str, float]`, imported when used."""

from __future__ import annotations

import importlib
from types import ModuleType

from kiln.errors import EvalError

TASKS = {
    "wikitext": "kiln.eval.wikitext",
    "gsm8k": "kiln.eval.gsm8k",
}


def get_task(name: str) -> ModuleType:
    if name not in TASKS:
        raise EvalError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}")
    return importlib.import_module(TASKS[name])
