# usage: build_at.sh TREE NAME QUANT : kiln build of the embedded SmolLM2 from TREE's kiln
tree=$1 name=$2 q=$3
cd /tmp/rot
PYTHONPATH=$tree OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m kiln.cli.main build --quantization $q --weight-rounding gptq-sequential \
  -o /tmp/rot/eng-$name --max-ppl-increase 100 > /tmp/rot/log-$name.txt 2>&1
/work/main/.venv/bin/python -c "
import json; m=json.load(open('/tmp/rot/eng-$name/kiln_engine.json')); a=m['accuracy']
print('$name', '$q', m.get('kiln_source_hash', m.get('engine_id')), round(a['source_word_perplexity'],5), round(a['engine_word_perplexity'],4), round(a['word_perplexity_increase_pct'],3))"
