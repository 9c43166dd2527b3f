# The kiln build runs of this folder: the embedded SmolLM2, both FP8 schemes, the build's own
# accuracy report (no limit: --max-ppl-increase 100), one build at a time, then the manifest's
# accuracy into NAME.json. Usage: bash run.sh [OUT_DIR] [CONFIGS...], CONFIGS like
# "fp8-dynamic:gptq-sequential"; EXTRA (env): more build flags, TAG: a suffix for NAME.
out=${1:-/tmp/acc2}; shift 2>/dev/null
configs=${@:-"fp8-dynamic:gptq-sequential fp8:gptq-sequential"}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
for cfg in $configs; do
  q=${cfg%%:*}; r=${cfg##*:}; name=$q-$r${TAG:+-$TAG}
  OMP_NUM_THREADS=1 python -m kiln.cli.main build --quantization $q --weight-rounding $r \
    -o "$out/smol-$name" --max-ppl-increase 100 $EXTRA > "$out/log-$name.txt" 2>&1
  python3 - "$out/smol-$name/kiln_engine.json" "$here/$name.json" <<'PY'
import json, sys
m = json.load(open(sys.argv[1]))
keep = ("engine_id", "quantization", "scales_method", "accuracy", "build_seconds",
        "calibration_data_hash", "kiln_version")
json.dump({k: m.get(k) for k in keep}, open(sys.argv[2], "w"), indent=1)
a = m["accuracy"]
print(sys.argv[2], round(a["engine_word_perplexity"], 3),
      f"{a['word_perplexity_increase_pct']:+.2f}%", m["build_seconds"])
PY
done
