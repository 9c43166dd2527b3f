"""Static fp8 on SmolLM2 with the attention sink's rows apart: static input scales calibrated
without each sequence's first position; at run time position 0's rows quantized per token.
Weights rounded to nearest (or gptq-sequential with /gptq=1). Fake-quant in the engine's reference
arithmetic (fp8_matmul on the codes), scored on held-out articles (the build's word perplexity).

    OMP_NUM_THREADS=2 python sink_static.py OUT.json N_ARTICLES CONFIG [CONFIG ...]

CONFIG: dynamic | static | static/sink=dyn | static/sink=clip [/gptq=1]"""
import json, math, sys, time
import torch
from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, token_loglikelihoods
from kiln.kernels.reference import quantize_fp8, fp8_matmul, FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams
from kiln.quantization.calibration import observe_projections
from kiln.quantization.sequential import RoundingSpec, round_sequentially

CURRENT = {"positions": None}

class Obs(LinearMethod):
    def __init__(self, inner):
        self.inner, self.amax, self.amax_nosink = inner, 0.0, 0.0
    def create_weights(self, layer, dtype):
        raise RuntimeError
    def apply(self, layer, ops, x):
        rows = x.reshape(-1, x.shape[-1]).float().abs().amax(-1)
        pos = CURRENT["positions"]
        self.amax = max(self.amax, float(rows.max()))
        keep = rows[pos != 0] if pos is not None and pos.numel() == rows.numel() else rows
        if keep.numel():
            self.amax_nosink = max(self.amax_nosink, float(keep.max()))
        return self.inner.apply(layer, ops, x)

class Fake(LinearMethod):
    def __init__(self, codes, scale, input_scale, sink):
        self.codes, self.scale, self.input_scale, self.sink = codes, scale.view(-1), input_scale, sink
    def create_weights(self, layer, dtype):
        raise RuntimeError
    def apply(self, layer, ops, x):
        rows = x.reshape(-1, x.shape[-1])
        r32 = rows.float()
        dyn = (r32.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
        if self.input_scale is None:
            s = dyn
        else:
            s = torch.full_like(dyn, self.input_scale)
            pos = CURRENT["positions"]
            if self.sink == "dyn" and pos is not None and pos.numel() == rows.shape[0]:
                s = torch.where((pos == 0)[:, None], dyn, s)
        q = (r32 / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        y = fp8_matmul(q, s, self.codes, self.scale, layer.bias, x.dtype)
        return y.reshape(*x.shape[:-1], -1)

N = int(sys.argv[2])
t0 = time.time()
llm = LLM(dtype="float32", enable_prefix_caching=False)
model = llm.engine.executor.runner.model
def grab(module, args, kwargs):
    CURRENT["positions"] = kwargs["positions"] if "positions" in kwargs else args[3]
model.register_forward_pre_hook(grab, with_kwargs=True)
tok = llm.get_tokenizer()
docs = wikitext_articles(HELD_OUT_FILE, N)
ids = [tok.encode(d, add_special_tokens=False) for d in docs]
words = [count_words(d) for d in docs]
def score():
    lls = token_loglikelihoods(llm, ids, prefix_token_id(llm))
    return [math.exp(-ll / w) for ll, w in zip(lls, words)] + [math.exp(-math.fsum(lls) / sum(words))]
source = score()
print("source", [round(p, 3) for p in source], flush=True)
text = open(CALIBRATION_FILE, encoding="utf-8").read(2_000_000)
one = SamplingParams(max_tokens=1, temperature=0.0)
run = lambda b: llm.generate(b, one)
modules = dict(model.named_modules())
layers = {n: m for n, m in modules.items() if isinstance(m, Linear) and n != "lm_head"}
obs = observe_projections(model, Obs, bq.calibration_batches(llm, text, 8), run)
amax = {n: max(o.amax / FP8_E4M3_MAX, FP8_MIN_SCALE) for n, o in obs.items()}
amax_nosink = {n: max(o.amax_nosink / FP8_E4M3_MAX, FP8_MIN_SCALE) for n, o in obs.items()}
ratio = sorted(((amax[n] / amax_nosink[n], n) for n in amax), reverse=True)[:8]
print("amax / amax without position 0:", [(round(r, 1), n) for r, n in ratio], flush=True)
nearest = {n: quantize_fp8(m.weight.detach().float(), None) for n, m in layers.items()}
result = {"source": source, "ratio_top": ratio, "configs": {}}
for config in sys.argv[3:]:
    kind, *rest = config.split("/")
    opts = dict(p.split("=") for p in rest)
    sink = opts.get("sink")
    scales = None if kind == "dynamic" else (amax if sink is None else amax_nosink)
    found = nearest
    if "gptq" in opts:
        with torch.no_grad():
            found = round_sequentially(model, llm.engine.executor.runner.ops, llm.engine.executor.runner.backend,
                                       bq.calibration_batches(llm, text, 32), RoundingSpec(aware=False, damp=0.1), scales)
    saved = []
    for n, m in layers.items():
        saved.append((m, m.method))
        q, s = found[n]
        m.method = Fake(q, s, None if scales is None else scales[n], sink)
    try:
        ppl = score()
    finally:
        for m, method in saved:
            m.method = method
    inc = [100 * (p / s - 1) for p, s in zip(ppl, source)]
    result["configs"][config] = {"word_perplexity": ppl, "increase_pct": inc}
    print(config, "article 1", f"{inc[0]:+.2f}%", "all", f"{inc[-1]:+.2f}%", [round(i, 2) for i in inc], round(time.time() - t0), flush=True)
    json.dump(result, open(sys.argv[1], "w"), indent=1)
