"""Where static fp8's underflow falls: per projection, on held-out text (source model, exact
activations), the output error of e4m3 at the build's static scale (amax of 8 windows) and of a
3-bit mantissa with unbounded exponent at the same scale (no underflow), relative to the
output's size; and the share of input elements below e4m3's normal range.

    OMP_NUM_THREADS=2 python underflow_where.py OUT.json N_ARTICLES"""
import json, sys
import torch
from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams
from kiln.quantization.calibration import observe_projections


def mantissa3(x):
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 16) / 16, e)


def e4m3(x):
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


class Obs(LinearMethod):
    def __init__(self, inner):
        self.inner, self.amax = inner, 0.0

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        self.amax = max(self.amax, float(x.float().abs().max()))
        return self.inner.apply(layer, ops, x)


class Probe(LinearMethod):
    def __init__(self, inner, scale):
        self.inner, self.scale = inner, scale
        self.sums = torch.zeros(5, dtype=torch.float64)  # |y|^2, e4m3 err, nounder err, dyn err, n_under

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        r = x.reshape(-1, x.shape[-1]).float()
        w = layer.weight.float()
        y = r @ w.T
        s = self.scale
        dyn = (r.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
        errs = [((f(r / sc) * sc - r) @ w.T).pow(2).sum() for f, sc in
                ((e4m3, s), (lambda v: mantissa3(v).clamp(-448, 448), s), (e4m3, dyn))]
        under = ((r.abs() < 2**-6 * s) & (r != 0)).sum()
        self.sums += torch.tensor([float(y.pow(2).sum()), *map(float, errs), float(under)],
                                  dtype=torch.float64)
        self.count = getattr(self, "count", 0) + r.numel()
        return self.inner.apply(layer, ops, x)


llm = LLM(dtype="float32", enable_prefix_caching=False)
model = llm.engine.executor.runner.model
text = open(CALIBRATION_FILE, encoding="utf-8").read(2_000_000)
one = SamplingParams(max_tokens=1, temperature=0.0)
run = lambda b: llm.generate(b, one)
obs = observe_projections(model, Obs, bq.calibration_batches(llm, text, 8), run)
scales = {n: max(o.amax / FP8_E4M3_MAX, FP8_MIN_SCALE) for n, o in obs.items()}
tok = llm.get_tokenizer()
docs = wikitext_articles(HELD_OUT_FILE, int(sys.argv[2]))
batches = []
for d in docs:
    ids = tok.encode(d, add_special_tokens=False)
    batches += [ids[i:i + 2048] for i in range(0, len(ids), 2048)]
layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"}
saved = {n: m.method for n, m in layers.items()}
for n, m in layers.items():
    m.method = Probe(m.method, scales[n])
try:
    for b in batches:
        run([b])
finally:
    rows = {}
    for n, m in layers.items():
        p = m.method
        y2, e_st, e_nu, e_dyn, under = p.sums.tolist()
        rows[n] = {"rel_err_static": e_st / y2, "rel_err_nounder": e_nu / y2,
                   "rel_err_dynamic": e_dyn / y2, "under_share": under / p.count}
        m.method = saved[n]
out = sorted(rows.items(), key=lambda kv: kv[1]["rel_err_static"] - kv[1]["rel_err_nounder"], reverse=True)
for n, r in out[:25]:
    print(f"{n:32s} static {r['rel_err_static']:.2e} nounder {r['rel_err_nounder']:.2e} "
          f"dynamic {r['rel_err_dynamic']:.2e} under {100 * r['under_share']:.1f}%")
json.dump(rows, open(sys.argv[1], "w"), indent=1)
