"""Token- against head-major KV cache blocks on the CPU, side by side (one process per run,
alternating): the embedded SmolLM2, 8 prompts of 300 tokens, 64 greedy tokens each.

    python benchmarks/cpu_kv_layout.py --out cpu_kv_layout.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ONE_RUN = """
import json, os, sys, time
from kiln import LLM, SamplingParams
llm = LLM(enable_prefix_caching=False)
prompts = [[1] + list(range(100 + i, 400 + i)) for i in range(8)]
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], params)  # warm-up
start = time.perf_counter()
outs = llm.generate(prompts, params)
seconds = time.perf_counter() - start
print(json.dumps({"layout": os.environ["KILN_KV_CACHE_LAYOUT"], "output_tok_s": 8 * 64 / seconds,
                  "tokens": [o.outputs[0].token_ids for o in outs]}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="cpu_kv_layout.json")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    runs = []
    for _ in range(args.repeats):
        for layout in ("token", "head"):
            env = {**os.environ, "KILN_KV_CACHE_LAYOUT": layout}
            done = subprocess.run(
                [sys.executable, "-c", ONE_RUN], env=env, capture_output=True, text=True, check=True
            )
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(layout, round(runs[-1]["output_tok_s"], 1), flush=True)
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    record = {"command": " ".join(sys.argv), "same_tokens": same, "runs": runs}
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)
    print("same tokens:", same)


if __name__ == "__main__":
    main()
