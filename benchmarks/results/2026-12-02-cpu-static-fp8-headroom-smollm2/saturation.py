"""Static fp8 on SmolLM2: do held-out activations exceed the calibrated absmax (saturation)?"""
import json, math, sys, time
import torch
from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.llm import LLM
from kiln.quantization.calibration import _ObservingMethod, observe_projections
from kiln.sampling_params import SamplingParams
t0 = time.time()
llm = LLM(dtype="float32", enable_prefix_caching=False)
model = llm.engine.executor.runner.model
tok = llm.get_tokenizer()
one = SamplingParams(max_tokens=1, temperature=0.0)
run = lambda b: llm.generate(b, one)
text = open(CALIBRATION_FILE, encoding='utf-8').read(800_000)
calib = bq.calibration_batches(llm, text)
print("calibration", len(calib), "x", len(calib[0]), round(time.time() - t0), flush=True)
cal = observe_projections(model, _ObservingMethod, calib, run)
docs = wikitext_articles(HELD_OUT_FILE, 3)
n = 512
held = []
for d in docs:
    ids = tok.encode(d, add_special_tokens=False)
    held += [ids[i : i + n] for i in range(0, len(ids), n)]
ev = observe_projections(model, _ObservingMethod, held, run)
rows = sorted(((ev[k].absmax / cal[k].absmax, k, cal[k].absmax, ev[k].absmax) for k in cal), reverse=True)
over = [r for r in rows if r[0] > 1.0]
print("held-out windows", len(held), "projections", len(rows), "saturating", len(over))
for r in rows[:15]:
    print(f"{r[0]:.2f} {r[1]} calib {r[2]:.1f} held-out {r[3]:.1f}")
json.dump({"ratios": [[r[1], r[0], r[2], r[3]] for r in rows]}, open("/tmp/saturation.json", "w"), indent=0)
print("s", round(time.time() - t0))
