for cfg in "fp8-dynamic nearest" "fp8-dynamic gptq" "fp8 gptq" "fp8 nearest"; do
  set -- $cfg
  OMP_NUM_THREADS=1 /work/main/.venv/bin/python -m kiln.cli.main build --quantization $1 --weight-rounding $2 -o /tmp/gq/smol-$1-$2 --max-ppl-increase 100 > /tmp/gq/log-$1-$2.txt 2>&1
  python3 -c "
import json;m=json.load(open('/tmp/gq/smol-$1-$2/kiln_engine.json'));a=m['accuracy'];print('$1 $2', {k:v for k,v in a.items() if 'perplex' in k or 'pct' in k}, m['build_seconds'])"
done
