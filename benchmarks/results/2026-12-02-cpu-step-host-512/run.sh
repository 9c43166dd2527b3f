#!/usr/bin/env bash
# Before/after, alternated, three processes each: BEFORE=a tree of kiln at 2415bd0 (this
# branch's base: `git archive 2415bd0 kiln | tar -x -C /tmp/host_before`), the tool from this
# tree for both (PYTHONPATH picks the kiln it drives). Run from the repo root, venv active.
set -eu
D=benchmarks/results/2026-12-02-cpu-step-host-512
BEFORE=${BEFORE:-/tmp/host_before}
for mode in plain tokenizer; do
    flag=""; [ $mode = tokenizer ] && flag="--tokenizer"
    for i in 1 2 3; do
        for tree in before after; do
            path=.; [ $tree = before ] && path=$BEFORE
            PYTHONPATH=$path OMP_NUM_THREADS=1 python benchmarks/step_host_batch_cpu.py \
                --repeats 1 --num-requests 1024 $flag --out $D/${mode}_${tree}_$i.json \
                2>&1 | grep '^median' | sed "s/^/$mode $tree $i /"
        done
    done
done
