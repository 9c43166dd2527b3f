#!/usr/bin/env bash
# Hand-pipelined packed float8 decode: kernel sweep, ncu of both, a short 1000/1000 A/B.
set -u
export NO_HF=1
R=$OUT/r; mkdir -p $R
python3 -m pip install -q --no-deps --no-index .scratch/wheels/*.whl 2>&1 | tail -2
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv > $R/gpu.txt
cp .scratch/dp/expected1.md $R/
PYTHONPATH=.:benchmarks:.scratch/dp timeout 260 python3 .scratch/dp/pf_sweep.py --out $R/pf.json 2>&1 | tee $R/sweep.txt | grep -v Warn
BEST=$(python3 -c "
import json; d=json.load(open('$R/pf.json'))
r=[s for s in d['shapes'] if s['batch']==768 and s['placement']=='random'][0]
b=r['best']; print(f\"{b['tiles'][0]},{b['tiles'][1]},{b['k_asm']},{b['natural']},{b['stages']}\")" 2>/dev/null || echo 16,4,0,0,1)
echo "best at 768x1500 random: $BEST" | tee -a $R/sweep.txt
if command -v ncu >/dev/null; then
  T2=$(echo $BEST | tr , ' ')
  PYTHONPATH=.:benchmarks:.scratch/dp timeout 150 ncu --kernel-name regex:"_decode_packed" --launch-skip 2 --launch-count 2 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    python3 .scratch/dp/ncu_target.py $T2 > $R/ncu.txt 2>&1; tail -3 $R/ncu.txt
else echo "no ncu" > $R/ncu.txt; fi
run() { OUT=$R "$@" 2>&1 | grep -E "===|tok/s|rror|Traceback" ; }
KILN_TREE=.scratch/pftree KILN_PF=$BEST TAG=warm run benchmarks/h200_run.sh tput1000-768-s8kv8
KILN_TREE=.scratch/base TAG=main run benchmarks/h200_run.sh tput1000-768-s8kv8
KILN_TREE=.scratch/pftree KILN_PF=$BEST TAG=pf run benchmarks/h200_run.sh tput1000-768-s8kv8
(( SECONDS < 470 )) && KILN_TREE=.scratch/base TAG=main2 run benchmarks/h200_run.sh tput1000-768-s8kv8
cd $OUT && tar czf r.tgz r && rm -rf r
