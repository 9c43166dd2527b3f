#!/usr/bin/env bash
# Call 2: float8 decode attention's waves at 640-1088 rows (decode_waves_sweep.py), then
# 1000/1000 at 1000 in flight: a forced split count against the rule if the sweep finds one
# >= 3% faster at 1000 x 1500, else this tree against base (.scratch/base = git archive 90cd7b9).
set -u
export NO_HF=1
R=$OUT
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -1
D=benchmarks/results/2026-12-03-h200-silu-static-grid/call2
PYTHONPATH=benchmarks:. timeout 200 python3 benchmarks/decode_waves_sweep.py --out $R/decode_waves.json 2>&1 | cut -c1-300 > $R/log.txt
cat $R/log.txt | grep -E "x1500|x2000|rror|Trace|variants"
SPLITS=$(python3 -c "
import json
d = json.load(open('$R/decode_waves.json'))
e = next(e for e in d['shapes'] if e['rows'] == 1000 and e['context'] == 1500)
best = min((1, 2, 3), key=lambda s: e[f'splits{s}']['us'])
print(best if best > 1 and e['splits1']['us'] / e[f'splits{best}']['us'] >= 1.03 else 0)
" 2>>$R/log.txt)
echo "forced splits: ${SPLITS:-none}" | tee -a $R/log.txt
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" | tee -a $R/log.txt; }
if [[ ${SPLITS:-0} -gt 0 ]]; then
    DMON=1 KILN_DECODE_NUM_SPLITS=$SPLITS TAG=splits$SPLITS run benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8
    DMON=1 TAG=rule run benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8
else
    DMON=1 TAG=grid run benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8
    DMON=1 KILN_TREE=.scratch/base TAG=base run benchmarks/h200_run.sh tput1000-3000-16k-1000-s8kv8
fi
