#!/bin/bash
# kiln's startup on the embedded SmolLM2 (GGUF), this branch against 2f5976f (the tree before the
# startup work, extracted with `git archive 2f5976f kiln | tar -x -C /tmp/i14-old`), interleaved
# run by run. Each command runs from its own tree's root (python puts the working directory first
# on sys.path, ahead of PYTHONPATH). OMP_NUM_THREADS=1 (kiln --threads 1): the machine is shared
# with other work; wall and CPU seconds (the process tree's user + system) are both recorded.
set -e
export OMP_NUM_THREADS=1
here="$(cd "$(dirname "$0")/../../.." && pwd)"
out=$here/benchmarks/results/2026-12-01-cpu-startup/startup.jsonl
prompt="What is the capital of France?"
for i in 1 2; do
  for tree in "$here" /tmp/i14-old; do
    cd "$tree"
    name=$([ "$tree" = "$here" ] && echo "this branch" || echo "2f5976f")
    python "$here/benchmarks/startup.py" generate --runs 1 --label "kiln generate, $name" \
      --output-json "$out" -- python -m kiln.cli.main generate --max-tokens 8 "$prompt"
    python "$here/benchmarks/startup.py" health --runs 1 --port 8131 --label "kiln serve, $name" \
      --output-json "$out" -- python -m kiln.cli.main serve --port 8131
  done
done
