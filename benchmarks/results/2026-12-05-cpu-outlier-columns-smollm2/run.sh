#!/usr/bin/env bash
# SmolLM2 FP8 builds with outlier columns under the build's three-article check, each with a
# limit high enough to write the manifest (the default 1% fails the ones above it).
set -u
mkdir -p /tmp/oc && cd /tmp/oc
. /work/main/.venv/bin/activate
export OMP_NUM_THREADS=2
run() {  # name, options...
    local name=$1; shift
    local t0=$SECONDS
    kiln build -o /tmp/oc/$name --cache-dir /tmp/oc/cache --max-ppl-increase 100 "$@" > /tmp/oc/$name.log 2>&1
    echo "$name exit $? $((SECONDS - t0)) s" | tee -a /tmp/oc/summary.txt
    python3 -c "import json; a=json.load(open('/tmp/oc/$name/kiln_engine.json'))['accuracy']; print('$name', json.dumps({k: a[k] for k in ('held_out', 'source_word_perplexity', 'engine_word_perplexity', 'word_perplexity_increase_pct') if k in a}))" | tee -a /tmp/oc/summary.txt
}
for spec in "$@"; do
    case $spec in
        static-gptqseq-oc16) run $spec --quantization fp8 --weight-rounding gptq-sequential --outlier-columns 16 ;;
        dyn-gptqseq-oc16) run $spec --quantization fp8-dynamic --weight-rounding gptq-sequential --outlier-columns 16 ;;
        static-nearest-oc16) run $spec --quantization fp8 --outlier-columns 16 ;;
        dyn-nearest-oc16) run $spec --quantization fp8-dynamic --outlier-columns 16 ;;
        static-gptqseq) run $spec --quantization fp8 --weight-rounding gptq-sequential ;;
        dyn-gptqseq) run $spec --quantization fp8-dynamic --weight-rounding gptq-sequential ;;
        static-nearest) run $spec --quantization fp8 ;;
        static-gptqseq-oc32) run $spec --quantization fp8 --weight-rounding gptq-sequential --outlier-columns 32 ;;
        dyn-gptqseq-oc32) run $spec --quantization fp8-dynamic --weight-rounding gptq-sequential --outlier-columns 32 ;;
        dyn-nearest) run $spec --quantization fp8-dynamic ;;
    esac
done
echo done >> /tmp/oc/summary.txt
