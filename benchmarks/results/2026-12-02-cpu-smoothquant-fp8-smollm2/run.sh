# kiln build of the embedded SmolLM2 with --smoothing, both FP8 schemes, GPTQ and nearest; the
# build's own accuracy report of each (no limit: --max-ppl-increase 100). One build at a time.
# Usage: bash run.sh [OUT_DIR] [ALPHA_SPEC] [CONFIGS...]; CONFIGS like "fp8-dynamic:gptq".
# KEEP=PATTERNS adds --unquantized-layers PATTERNS (and SUFFIX to the result's name).
out=${1:-/tmp/sq}; spec=${2:-smoothquant}; shift 2 2>/dev/null
configs=${@:-"fp8-dynamic:gptq fp8:gptq fp8-dynamic:nearest fp8:nearest"}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for cfg in $configs; do
  q=${cfg%%:*}; r=${cfg##*:}; name=$q-$r-${spec/:/-}$SUFFIX
  OMP_NUM_THREADS=1 python -m kiln.cli.main build --quantization $q --weight-rounding $r \
    --smoothing $spec ${KEEP:+--unquantized-layers $KEEP} -o "$out/smol-$name" \
    --max-ppl-increase 100 > "$out/log-$name.txt" 2>&1
  python3 - "$out/smol-$name/kiln_engine.json" "$here/$name.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
keep = ("engine_id", "quantization", "scales_method", "smoothing", "accuracy", "build_seconds",
        "calibration_data_hash", "kiln_version", "unquantized_layers")
json.dump({k: m.get(k) for k in keep}, open(sys.argv[2], "w"), indent=1)
a = m["accuracy"]
print(sys.argv[2], round(a["engine_word_perplexity"], 3),
      f"{a['word_perplexity_increase_pct']:+.2f}%", m["build_seconds"])
PY
done
