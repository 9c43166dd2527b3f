"""Static fp8 on SmolLM2 with each projection's loudest input channels kept exact (or as two
e4m3 terms), against per-token and plain static scales; activations fake-quantized, weights
fp32, rounded to nearest, or gptq-sequential (the build's rounding). Scored on held-out articles:
the build's word perplexity, and the mean |change| of each token's log-probability against the
source (a damage measure that does not cancel, unlike the perplexity's mean).

    OMP_NUM_THREADS=2 python outlier.py OUT.json N_ARTICLES CONFIG [CONFIG ...]

CONFIG: MODE[/w=fp32|nearest|gptq|gptq32][/fixed=K|/resid=K][/exact=K]; MODE dynamic | static;
fixed=K: the K channels of largest calibration amax of each projection exact at run time;
resid=K: those channels as two e4m3 terms at the tensor's scale (x ~ q + q(x - q));
exact=K: each row's K largest |values| exact (not a run-time scheme: the bound);
wexact=K: the weight's columns of the same K channels unrounded (fp32)."""
import json, math, sys, time
import torch
from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, scored_windows
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE, quantize_fp8
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams
from kiln.quantization.calibration import observe_projections
from kiln.quantization.sequential import RoundingSpec, round_sequentially


def e4m3(x):
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


class Obs(LinearMethod):
    def __init__(self, inner):
        self.inner, self.channel_amax = inner, None

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        c = x.reshape(-1, x.shape[-1]).float().abs().amax(0)
        self.channel_amax = c if self.channel_amax is None else torch.maximum(self.channel_amax, c)
        return self.inner.apply(layer, ops, x)


class Fake(LinearMethod):
    def __init__(self, inner, weight, input_scale, channels, residual, exact):
        self.inner, self.weight, self.input_scale = inner, weight, input_scale
        self.channels, self.residual, self.exact = channels, residual, exact

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        r = x.reshape(-1, x.shape[-1]).float()
        if self.input_scale is None:
            s = (r.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
        else:
            s = torch.tensor(self.input_scale)
        v = r / s
        q = e4m3(v)
        if self.channels is not None:
            c = self.channels
            q[:, c] = q[:, c] + e4m3(v[:, c] - q[:, c]) if self.residual else v[:, c]
        if self.exact:
            idx = v.abs().topk(self.exact, dim=-1).indices
            q = q.scatter(-1, idx, v.gather(-1, idx))
        y = (q * s) @ self.weight.T
        return y.to(x.dtype).reshape(*x.shape[:-1], -1)


N = int(sys.argv[2])
t0 = time.time()
llm = LLM(dtype="float32", enable_prefix_caching=False)
runner = llm.engine.executor.runner
model = runner.model
tok = llm.get_tokenizer()
docs = wikitext_articles(HELD_OUT_FILE, N)
ids = [tok.encode(d, add_special_tokens=False) for d in docs]
words = [count_words(d) for d in docs]


def score():
    per_doc = [[] for _ in ids]
    for i, lps in scored_windows(llm, ids, prefix_token_id(llm)):
        per_doc[i] += lps
    return per_doc


source = score()
src_flat = torch.tensor([v for d in source for v in d], dtype=torch.float64)


def summary(per_doc):
    lls = [math.fsum(d) for d in per_doc]
    ppl = [math.exp(-ll / w) for ll, w in zip(lls, words)]
    ppl.append(math.exp(-math.fsum(lls) / sum(words)))
    flat = torch.tensor([v for d in per_doc for v in d], dtype=torch.float64)
    return ppl, float((flat - src_flat).abs().mean())


source_ppl, _ = summary(source)
print("source", [round(p, 3) for p in source_ppl], flush=True)
text = open(CALIBRATION_FILE, encoding="utf-8").read(2_000_000)
one = SamplingParams(max_tokens=1, temperature=0.0)
run = lambda b: llm.generate(b, one)
layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"}
obs = observe_projections(model, Obs, bq.calibration_batches(llm, text, 8), run)
channel_amax = {n: o.channel_amax for n, o in obs.items()}
static = {n: max(float(c.max()) / FP8_E4M3_MAX, FP8_MIN_SCALE) for n, c in channel_amax.items()}
fp32 = {n: m.weight.detach().float() for n, m in layers.items()}
nearest = {}
for n, w in fp32.items():
    q, s = quantize_fp8(w, None)
    nearest[n] = q.float() * s.float().view(-1, 1)
gptq_cache = {}
result = {"source": source_ppl, "configs": {}}
for config in sys.argv[3:]:
    mode, *rest = config.split("/")
    opts = dict(p.split("=") for p in rest)
    scales = None if mode == "dynamic" else static
    k = int(opts.get("fixed", opts.get("resid", 0)))
    w = opts.get("w", "fp32")
    if w.startswith("gptq"):
        # gptq: 8 windows, damp 0.01; gptq32: the build's 32 windows and damp 0.1
        windows, damp = (32, 0.1) if w == "gptq32" else (8, 0.01)
        if (mode, w) not in gptq_cache:
            with torch.no_grad():
                found = round_sequentially(
                    model, runner.ops, runner.backend, bq.calibration_batches(llm, text, windows),
                    RoundingSpec(aware=False, damp=damp), scales,
                )
            gptq_cache[mode, w] = {n: q.float() * s.float().view(-1, 1) for n, (q, s) in found.items()}
        weights = gptq_cache[mode, w]
    else:
        weights = {"fp32": fp32, "nearest": nearest}[w]
    kw = int(opts.get("wexact", 0))
    saved = []
    for n, m in layers.items():
        saved.append((m, m.method))
        weight = weights[n]
        if kw:
            cols = channel_amax[n].topk(kw).indices
            weight = weight.clone()
            weight[:, cols] = fp32[n][:, cols]
        m.method = Fake(
            m.method, weight, None if scales is None else scales[n],
            channel_amax[n].topk(k).indices if k else None, "resid" in opts,
            int(opts.get("exact", 0)),
        )
    try:
        ppl, damage = summary(score())
    finally:
        for m, method in saved:
            m.method = method
    inc = [100 * (p / s - 1) for p, s in zip(ppl, source_ppl)]
    result["configs"][config] = {
        "word_perplexity": ppl, "increase_pct": inc, "mean_abs_logprob_change": damage,
    }
    print(f"{config:28s} all {inc[-1]:+.2f}% |dlogp| {damage:.4f}",
          [round(i, 2) for i in inc[:-1]], round(time.time() - t0), flush=True)
    json.dump(result, open(sys.argv[1], "w"), indent=1)
