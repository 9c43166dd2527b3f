# Call 4, run on call 3's machine (its engines still in /tmp/kiln-outlier-e2e), from the
# repository root: each workload with the outlier engine first, then plain.
export PYTHONPATH=.
for w in lat tput; do
  for e in outlier plain; do
    if [ $w = lat ]; then
      A="latency --input-len 1024 --output-len 128 --num-requests 3"
    else
      A="throughput --input-len 128 --output-len 128 --num-requests 2048 --max-num-seqs 512 --max-num-batched-tokens 8192 --warmup 64"
    fi
    timeout 120 python3 -P -m kiln.cli.main bench $A --model /tmp/kiln-outlier-e2e/$e \
      --no-progress --output-json $OUT/${w}_${e}_rev.json > $OUT/${w}_${e}_rev.log 2>&1
  done
done
