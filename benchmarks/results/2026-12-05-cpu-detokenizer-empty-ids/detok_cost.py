"""The incremental detokenizer's cost a token when most ids decode to nothing: the tests' tiny
byte-level tokenizer (384 entries) over ids drawn from Llama-3.1-8B's 128,256, as the 8B engines
of ../2026-12-05-h200-outlier-e2e-one-row-cost sampled them. The code before the fix
(kiln/engine/detokenizer.py at a262726~1) and kiln's, side by
side in one process; 32 requests, one id appended at a time.

    PYTHONPATH=. python benchmarks/results/2026-12-05-cpu-detokenizer-empty-ids/detok_cost.py
"""

import importlib.util
import json
import pathlib
import random
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, ".")
from kiln.engine.detokenizer import IncrementalDetokenizer  # noqa: E402
from tests.tiny_tokenizer import build_tokenizer  # noqa: E402

old_source = subprocess.run(
    ["git", "show", "a262726~1:kiln/engine/detokenizer.py"], capture_output=True, check=True
).stdout
with tempfile.TemporaryDirectory() as tmp:
    path = pathlib.Path(tmp) / "detokenizer_before.py"
    path.write_bytes(old_source)
    spec = importlib.util.spec_from_file_location("before", path)
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)

tokenizer = build_tokenizer()
results = {"tokenizer_entries": len(tokenizer), "us_per_token": {}}
for n_out in (128, 1000):
    rng = random.Random(n_out)
    requests = [[rng.randrange(128256) for _ in range(n_out)] for _ in range(32)]
    for name, cls in (("before", before.IncrementalDetokenizer), ("now", IncrementalDetokenizer)):
        start = time.perf_counter()
        texts = []
        for ids in requests:
            detok = cls(tokenizer, [5, 6, 7])
            for i in ids:
                detok.append([i])
            detok.flush()
            texts.append(detok.text)
        us = (time.perf_counter() - start) / (32 * n_out) * 1e6
        results["us_per_token"][f"{name}_{n_out}"] = round(us, 1)
        results.setdefault("texts", {}).setdefault(n_out, []).append(texts)
    same = results["texts"].pop(n_out)
    results[f"same_text_{n_out}"] = same[0] == same[1]
del results["texts"]
print(json.dumps(results, indent=1))
