# usage: build.sh NAME DIR ROUNDING [extra]
name=$1 dir=$2 r=$3; shift 3
cd /tmp/rot
OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m kiln.cli.main build $dir --quantization fp8 --weight-rounding $r \
  -o /tmp/rot/eng-$name --max-ppl-increase 100 "$@" > /tmp/rot/log-$name.txt 2>&1
/work/main/.venv/bin/python - /tmp/rot/eng-$name/kiln_engine.json /tmp/rot/$name.json <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
keep = ("engine_id", "quantization", "scales_method", "accuracy", "build_seconds", "calibration_data_hash")
json.dump({k: m.get(k) for k in keep}, open(sys.argv[2], "w"), indent=1)
a = m["accuracy"]
print(sys.argv[2], round(a["source_word_perplexity"], 4), round(a["engine_word_perplexity"], 4), f"{a['word_perplexity_increase_pct']:+.2f}%", m["build_seconds"])
PY
