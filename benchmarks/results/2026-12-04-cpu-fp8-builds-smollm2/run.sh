#!/usr/bin/env bash
# SmolLM2 builds with the three-article check, each with a limit high enough to write the manifest.
set -u
cd /tmp/builds
. /work/main/.venv/bin/activate
export OMP_NUM_THREADS=2
run() {  # name, options...
    local name=$1; shift
    local t0=$SECONDS
    kiln build -o /tmp/builds/$name --cache-dir /tmp/builds/cache --max-ppl-increase 100 "$@" > /tmp/builds/$name.log 2>&1
    echo "$name exit $? $((SECONDS - t0)) s" | tee -a /tmp/builds/summary.txt
    python3 -c "import json; a=json.load(open('/tmp/builds/$name/kiln_engine.json'))['accuracy']; print('$name', json.dumps({k: a[k] for k in ('held_out', 'source_word_perplexity', 'engine_word_perplexity', 'word_perplexity_increase_pct') if k in a}))" | tee -a /tmp/builds/summary.txt
}
run dyn-nearest --quantization fp8-dynamic
run static-nearest --quantization fp8
run kv8 --kv-cache-dtype fp8
run dyn-gptqseq --quantization fp8-dynamic --weight-rounding gptq-sequential
run static-gptqseq --quantization fp8 --weight-rounding gptq-sequential
run dyn-gptqseq-kv8 --quantization fp8-dynamic --weight-rounding gptq-sequential --kv-cache-dtype fp8
echo done >> /tmp/builds/summary.txt
