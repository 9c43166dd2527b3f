"""Which part of e4m3's rounding costs static fp8 its accuracy on SmolLM2: underflow (quiet
values below the scale's normal range), saturation (held-out values above 448 x scale) or the
3-bit mantissa itself. Activations only (weights stay fp32), every decoder projection's input
fake-quantized and dequantized, then the source's own matmul; scored on held-out articles with
the build's word perplexity.

    OMP_NUM_THREADS=2 python parts.py OUT.json N_ARTICLES CONFIG [CONFIG ...]

CONFIG: MODE/FORMAT[/A=headroom][/windows=N][/fixed=K][/resid=K]; MODE dynamic | static;
fixed=K: the K channels of largest calibration amax of each projection kept exact; resid=K: the
same channels as two e4m3 terms at the tensor's scale (x ~ q + q(x - q)); FORMAT
    e4m3        the engine's rounding (underflow and saturation)
    nounder     3-bit mantissa, unbounded exponent below, clipped at 448 (no underflow)
    nosat       e4m3 below 448, 3-bit mantissa above it, unclipped (no saturation)
    mantissa    3-bit mantissa only (neither)
    exactK      e4m3, but each row's K largest |values| kept exact (per token, the largest is
                exact already: it is the scale)"""
import json, math, sys, time
import torch
from kiln.builder import quantize as bq
from kiln.builder.accuracy import CALIBRATION_FILE, HELD_OUT_FILE, wikitext_articles
from kiln.eval.perplexity import count_words, prefix_token_id, token_loglikelihoods
from kiln.kernels.reference import FP8_E4M3_MAX, FP8_MIN_SCALE
from kiln.layers.linear import Linear, LinearMethod
from kiln.llm import LLM
from kiln.sampling_params import SamplingParams
from kiln.quantization.calibration import observe_projections


def mantissa3(x):
    """Round to 4 significant bits (e4m3's 1 + 3) with any exponent."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.round(m * 16) / 16, e)


def e4m3(x):
    return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()


def exact_top(k):
    def fmt(x):
        q = e4m3(x)
        idx = x.abs().topk(k, dim=-1).indices
        return q.scatter(-1, idx, x.gather(-1, idx))
    return fmt


FORMATS = {
    **{f"exact{k}": exact_top(k) for k in (1, 2, 4, 8)},
    "e4m3": e4m3,
    "nounder": lambda x: mantissa3(x).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX),
    "nosat": lambda x: torch.where(x.abs() > FP8_E4M3_MAX, mantissa3(x), e4m3(x)),
    "mantissa": mantissa3,
}


class Obs(LinearMethod):
    def __init__(self, inner):
        self.inner, self.amax, self.channel_amax = inner, 0.0, None

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        c = x.reshape(-1, x.shape[-1]).float().abs().amax(0)
        self.channel_amax = c if self.channel_amax is None else torch.maximum(self.channel_amax, c)
        self.amax = max(self.amax, float(c.max()))
        return self.inner.apply(layer, ops, x)


class Fake(LinearMethod):
    def __init__(self, inner, input_scale, fmt, channels=None, residual=False):
        self.inner, self.input_scale, self.fmt = inner, input_scale, fmt
        self.channels, self.residual = channels, residual

    def create_weights(self, layer, dtype):
        raise RuntimeError

    def apply(self, layer, ops, x):
        r = x.reshape(-1, x.shape[-1]).float()
        if self.input_scale is None:
            s = (r.abs().amax(-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=FP8_MIN_SCALE)
        else:
            s = torch.tensor(self.input_scale)
        v = r / s
        q = self.fmt(v)
        if self.channels is not None:
            c = self.channels
            # the chosen channels exact, or as two e4m3 terms at the same scale (q + q(rest))
            q[:, c] = q[:, c] + e4m3(v[:, c] - q[:, c]) if self.residual else v[:, c]
        xq = (q * s).to(x.dtype).reshape(x.shape)
        return self.inner.apply(layer, ops, xq)


N = int(sys.argv[2])
t0 = time.time()
llm = LLM(dtype="float32", enable_prefix_caching=False)
model = llm.engine.executor.runner.model
tok = llm.get_tokenizer()
docs = wikitext_articles(HELD_OUT_FILE, N)
ids = [tok.encode(d, add_special_tokens=False) for d in docs]
words = [count_words(d) for d in docs]


def score():
    lls = token_loglikelihoods(llm, ids, prefix_token_id(llm))
    per = [math.exp(-ll / w) for ll, w in zip(lls, words)]
    return per + [math.exp(-math.fsum(lls) / sum(words))]


source = score()
print("source", [round(p, 3) for p in source], flush=True)
text = open(CALIBRATION_FILE, encoding="utf-8").read(2_000_000)
one = SamplingParams(max_tokens=1, temperature=0.0)
run = lambda b: llm.generate(b, one)
layers = {
    n: m for n, m in model.named_modules() if isinstance(m, Linear) and n != "lm_head"
}
amax_by_windows = {}
result = {"source": source, "configs": {}}
for config in sys.argv[3:]:
    mode, fmt, *rest = config.split("/")
    opts = dict(p.split("=") for p in rest)
    headroom = float(opts.get("A", 1))
    windows = int(opts.get("windows", 8))
    scales = None
    k = int(opts.get("fixed", opts.get("resid", 0)))
    if mode == "static" or k:
        if windows not in amax_by_windows:
            obs = observe_projections(model, Obs, bq.calibration_batches(llm, text, windows), run)
            amax_by_windows[windows] = {n: (o.amax, o.channel_amax) for n, o in obs.items()}
        scales = {
            n: max(headroom * a / FP8_E4M3_MAX, FP8_MIN_SCALE)
            for n, (a, _) in amax_by_windows[windows].items()
        }
    channels = {
        n: c.topk(k).indices if k else None for n, (_, c) in amax_by_windows.get(windows, {}).items()
    }
    saved = []
    for n, m in layers.items():
        saved.append((m, m.method))
        m.method = Fake(
            m.method, None if mode == "dynamic" else scales[n], FORMATS[fmt],
            channels.get(n), "resid" in opts,
        )
    try:
        ppl = score()
    finally:
        for m, method in saved:
            m.method = method
    inc = [100 * (p / s - 1) for p, s in zip(ppl, source)]
    result["configs"][config] = {"word_perplexity": ppl, "increase_pct": inc}
    print(config, "article 1", f"{inc[0]:+.2f}%", "all", f"{inc[-1]:+.2f}%",
          [round(i, 2) for i in inc], round(time.time() - t0), flush=True)
    json.dump(result, open(sys.argv[1], "w"), indent=1)
